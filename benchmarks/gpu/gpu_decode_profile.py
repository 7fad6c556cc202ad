"""Where the decode step's time goes (issue 39's decode target, issue 35's items 5-6): one short,
prepared device run after the first GPU check found the step at 24x its bandwidth floor.

    python -m benchmarks.gpu.gpu_decode_profile OUT_DIR [--smoke] [--tokens 8192] [--sdpa any] [--only PARTS]
    (PARTS: growing,step,hf,profile,batch,pooled)

On the 8B-shaped random model (bf16) after a full prefill of ~n tokens, at batch 1:
- `growing`: decode steps at growing positions (a new key length each, as serving runs them) and
  full prefills of new lengths, under the runner's SDPA restriction (`--sdpa any` lifts it);
- `eager_ms`: `BlendEngine.decode_step` as the engine runs it (median of 10);
- `graph_ms`: the same `decode_batch` captured once as a CUDA graph and replayed at the same position
  (what the GPU needs when the host launches nothing: the kernels' own time);
- `hf_ms`: transformers' own decode step (`model(ids, past_key_values=...)`, sdpa), the peer;
- a torch.profiler table of one eager step (top ops by device and by host time, kernel count);
then `decode_batch` at batch 1/16/64 over ~1K-token contexts (eager), to see how the per-sequence
attention scales, and (`pooled`) the same batches as runs of one paged pool, per_sequence against
pooled attention (one call a layer, `executor.decode`; `benchmarks.kernels.decode_attention`). Everything is
written to OUT_DIR/decode_profile_{restricted,any}.{json,txt} as it goes.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from benchmarks.gpu.gpu_check import _tokenizer
from benchmarks.gpu.gpu_common import QUESTIONS, HeldStore, Setup, make_passages, median_ms, profiled
from benchmarks.gpu.gpu_timing import random_runner
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.decode import decode_batch
from blend_engine.types import BlendPlan

logger = logging.getLogger("gpu_decode_profile")


def _prefilled(engine: BlendEngine, n_tokens: int, seed: int, extra: int):
    passages = make_passages(engine, n_tokens - 64, seed=seed)
    state = engine.prefill(BlendPlan(tuple(passages), QUESTIONS[0], mode="full_prefill"), max_new_tokens=extra)
    return state.cache, int(state.logits.argmax())


def eager_and_graph(setup: Setup, engine: BlendEngine, n_tokens: int) -> dict:
    cache, token = _prefilled(engine, n_tokens, 5, 64)
    start = cache.length
    row: dict = {"tokens": start}

    def step() -> None:  # the same position each time: the cache's length is reset
        cache.length = start
        engine.decode_step(cache, token)

    row["eager_ms"] = median_ms(step, setup, 10)
    if setup.device.type == "cuda":
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up on the capture stream
                for _ in range(3):
                    decode_batch(engine.runner, [cache], [token], [start])
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode_batch(engine.runner, [cache], [token], [start])
            row["graph_ms"] = median_ms(graph.replay, setup, 10)
        except Exception as exc:  # noqa: BLE001 - a one-shot diagnostic reports what it can
            row["graph_error"] = repr(exc)[:400]
    return row


def growing(setup: Setup, engine: BlendEngine, n_tokens: int) -> dict:
    """Decode steps as serving runs them (each at the next position: a new key length every step) and
    full prefills of new lengths, under the runner's SDPA restriction (`--sdpa`)."""
    passages = make_passages(engine, n_tokens - 64, seed=9)
    cache, token = _prefilled(engine, n_tokens, 5, 64)
    steps = iter(range(64))
    start = cache.length

    def step() -> None:
        cache.length = start + next(steps)
        engine.decode_step(cache, token)

    row: dict = {"sdpa_backends": str(engine.runner.sdpa_backends), "decode_ms": median_ms(step, setup, 10)}
    times = []
    for i in range(3):  # a question of a new length each time: a new shape for every kernel
        plan = BlendPlan(tuple(passages), QUESTIONS[0] + " again" * (i + 1), mode="full_prefill")
        setup.sync()
        t0 = time.perf_counter()
        engine.prefill(plan, max_new_tokens=1)
        setup.sync()
        times.append((time.perf_counter() - t0) * 1e3)
    row["prefill_ms"] = times
    return row


def hf_step(setup: Setup, engine: BlendEngine, n_tokens: int) -> dict:
    model = engine.runner.model
    ids = torch.randint(100, 1000, (1, n_tokens), device=setup.device)
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    past, nxt = out.past_key_values, ids[:, -1:]

    def step() -> None:
        with torch.no_grad():
            model(nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
            past.crop(-1)  # back to the same length each time

    return {"hf_ms": median_ms(step, setup, 10)}


def profile_table(setup: Setup, engine: BlendEngine, n_tokens: int) -> str:
    cache, token = _prefilled(engine, n_tokens, 7, 16)
    start = cache.length

    def step() -> None:  # the same position each time: the cache's length is reset
        cache.length = start
        engine.decode_step(cache, token)

    prof, _ = profiled(setup, step)
    avg = prof.key_averages()
    by_dev = "self_cuda_time_total" if setup.device.type == "cuda" else "self_cpu_time_total"
    return (avg.table(sort_by=by_dev, row_limit=20, max_name_column_width=60) + "\n\n"
            + avg.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


def batch_scaling(setup: Setup, engine: BlendEngine, n_tokens: int, sizes: tuple[int, ...]) -> list[dict]:
    made = [_prefilled(engine, n_tokens, 20 + i, 64) for i in range(max(sizes))]
    rows = []
    for b in sizes:
        caches, tokens = [c for c, _ in made[:b]], [t for _, t in made[:b]]
        starts = [c.length for c in caches]

        def step(caches=caches, tokens=tokens, starts=starts) -> None:
            decode_batch(engine.runner, caches, tokens, starts)

        rows.append({"batch": b, "tokens": n_tokens, "eager_ms": median_ms(step, setup, 5)})
        logger.info("batch %s", rows[-1])
    return rows


def pooled_vs_per_sequence(engine: BlendEngine, n_tokens: int, sizes: tuple[int, ...]) -> list[dict]:
    """Both decode attentions over runs of one pool (`benchmarks.kernels.decode_attention.step_ms`)."""
    from benchmarks.kernels.decode_attention import step_ms

    rows = []
    for b in sizes:
        row = {"batch": b, "tokens": n_tokens,
               **{f"{a}_ms": step_ms(engine.runner, b, n_tokens, a, 5) for a in ("per_sequence", "pooled")}}
        rows.append(row)
        logger.info("pooled %s", row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--sdpa", choices=("restricted", "any"), default="restricted",
                    help="any: every SDPA kernel eligible, cuDNN's included (runner.CUDA_SDPA_BACKENDS = None)")
    ap.add_argument("--only", default=None, help="comma-separated parts (growing,step,hf,profile,batch)")
    args = ap.parse_args(argv)
    if args.sdpa == "any":
        import blend_engine.model.runner

        blend_engine.model.runner.CUDA_SDPA_BACKENDS = None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cuda = torch.cuda.is_available() and not args.smoke
    setup = Setup(torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32, args.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"torch": torch.__version__}
    t0 = time.perf_counter()

    def save(text: str = "") -> None:
        result["seconds"] = time.perf_counter() - t0
        (args.out / f"decode_profile_{args.sdpa}.json").write_text(json.dumps(result, indent=2))
        if text:
            with open(args.out / f"decode_profile_{args.sdpa}.txt", "a") as f:
                f.write(text + "\n")

    runner = random_runner(setup, _tokenizer(None if args.smoke else Path(".gpucarry/smollm2")))
    engine = BlendEngine(runner, HeldStore("none", lambda t: t), EngineConfig(kv_format="bf16" if cuda else "fp32"))
    n = 512 if args.smoke else args.tokens
    for name, fn in [("growing", lambda: growing(setup, engine, n)),
                     ("step", lambda: eager_and_graph(setup, engine, n)),
                     ("hf", lambda: hf_step(setup, engine, n)),
                     ("profile", lambda: profile_table(setup, engine, n)),
                     ("batch", lambda: batch_scaling(setup, engine, 512 if args.smoke else 1024,
                                                     (1, 4) if args.smoke else (1, 16, 64))),
                     ("pooled", lambda: pooled_vs_per_sequence(engine, 512 if args.smoke else 1024,
                                                               (1, 4) if args.smoke else (1, 16, 64)))]:
        if args.only and name not in args.only.split(","):
            continue
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001
            logger.exception("%s failed", name)
            result[f"{name}_error"] = repr(exc)[:600]
            save()
            continue
        if isinstance(value, str):
            save(value)
            print(value)
        else:
            result[name] = value
            logger.info("%s: %s", name, value)
            save()
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
