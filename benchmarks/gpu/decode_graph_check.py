"""The decode step replayed as CUDA graphs (issue #35 item 6): equal to the eager step, and how
close to its bandwidth floor a batched step gets (issue #35's GPU target: batch 64 on the 8B shape
within 2x).

    python -m benchmarks.gpu.decode_graph_check OUT_DIR [--smollm .gpucarry/smollm2] [--smoke]
        [--batch 1,16,64] [--tokens 1024] [--reps 10] [--only equal,steps,kernel,batched]

1. `equal`: on SmolLM2 (fp32 and the run dtype), B ragged sequences in runs of one pool decode
   several steps at growing positions (crossing a key bucket, then a batch that shrinks) with
   per-sequence attention (the oracle), eagerly pooled and from captured graphs (each pooled
   kernel), from the same pool contents: the largest logit and K/V differences, whether greedy
   tokens agree, how many graphs were captured.
2. `steps`: on the Llama-3.1-8B-shaped random model (bf16), batch B over T-token contexts: one
   step with per-sequence attention, with pooled attention (eager; keys gathered, and the Triton
   kernel that reads the pool in place), and replayed from its graph with each (`DecodeGraphs.step`:
   the inputs' upload and the logits' copy included), the first capture's time apart; beside them
   the floor: every weight once plus the batch's K/V once over the
   device's copy bandwidth (`gpu_decode`).
3. `kernel`: one layer's decode attention alone (8B shape): the Triton kernel's (block, warps,
   key ranges) variants against gather + SDPA, in GB/s of K/V read (`--tokens 8192 --batch 1` for
   the long single stream that key ranges are for).
4. `batched`: the engine loop's batched run (`gpu_batch`, 64 clients each blending ~8K tokens and
   decoding 32) with decode graphs off, then on.
Results go to OUT_DIR/decode_graphs.json as each part ends. On a CPU (`--smoke`: tiny shapes) the
graph rows run the same padded step eagerly (capture needs CUDA).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu.gpu_common import Setup, median_ms, profiled
from benchmarks.kernels.decode_attention import pool_runs
from blend_engine.executor.decode import decode_batch
from blend_engine.executor.decode_graphs import DecodeGraphs
from blend_engine.executor.kv_pool import KVPool
from blend_engine.model.runner import ModelRunner

logger = logging.getLogger("decode_graph_check")


def _steps(runner: ModelRunner, pool: KVPool, runs, lengths: list[int], steps: int,
           graphs: DecodeGraphs | None, attention: str = "pooled", kernel: str | None = None) -> list[torch.Tensor]:
    """`steps` decode steps from the given lengths: all rows, then (second half) all but the last two."""
    caches = [pool.view(run, n) for run, n in zip(runs, lengths)]
    out = []
    for s in range(steps):
        rows = caches if s < steps // 2 else caches[:max(1, len(caches) - 2)]
        tokens = [100 + 7 * b + s for b in range(len(rows))]
        out.append(decode_batch(runner, rows, tokens, [c.length for c in rows], attention, graphs, kernel).float().cpu())
    return out


def compare_captured_and_eager(runner: ModelRunner, steps: int = 6, batch: int = 5, kernel: str | None = None) -> dict:
    """The same steps from the same pool contents four ways: per-sequence attention (the oracle),
    eager pooled (unpadded), the padded step run eagerly (`capture=False`) and replayed from captured
    graphs, the pooled ones with `kernel` (None: `decode.pooled_kernel`'s). Captured vs padded differ
    only if capture broke something (same kernels, same shapes); the others by the fp rounding of
    other kernels and GEMM shapes."""
    from blend_engine.executor.decode import pooled_kernel

    kernel = kernel or pooled_kernel(runner.device)
    lengths = [253 - 40 * b for b in range(batch)]  # the longest crosses the 256-key bucket at step 3
    pool, runs = pool_runs(runner, batch, max(lengths) + steps)
    slots = pool.scratch_slot
    start = [(k[:, :slots].clone(), v[:, :slots].clone()) for k, v in zip(*pool.kv)]
    logits, kv, n_graphs = {}, {}, 0
    cuda = runner.device.type == "cuda"
    for way in ("oracle", "eager", "padded", "captured") if cuda else ("oracle", "eager", "padded"):  # capture: CUDA
        for (k, v), (k0, v0) in zip(zip(*pool.kv), start):
            k[:, :slots], v[:, :slots] = k0, v0
        graphs = DecodeGraphs(runner, pool, capture=way == "captured", kernel=kernel) if way in ("padded", "captured") \
            else None
        attention = "per_sequence" if way == "oracle" else "pooled"
        logits[way] = _steps(runner, pool, runs, lengths, steps, graphs, attention, kernel)
        kv[way] = [(k[:, :slots].clone(), v[:, :slots].clone()) for k, v in zip(*pool.kv)]
        n_graphs = len(graphs.graphs) if graphs is not None else n_graphs

    def logit_diff(a: str, b: str) -> float:
        return max((x - y).abs().max().item() for x, y in zip(logits[a], logits[b]))

    def kv_diff(a: str, b: str) -> float:
        return max(max((k - k2).abs().max().item(), (v - v2).abs().max().item())
                   for (k, v), (k2, v2) in zip(kv[a], kv[b]))

    captured = "captured" if cuda else "padded"
    return {"dtype": str(runner.dtype), "kernel": kernel, "batch": batch, "steps": steps, "graphs": n_graphs,
            "capture_ran": cuda,
            "captured_vs_padded_logit_diff": logit_diff(captured, "padded"),
            "captured_vs_padded_kv_diff": kv_diff(captured, "padded"),
            "padded_vs_eager_logit_diff": logit_diff("padded", "eager"),
            "eager_vs_oracle_logit_diff": logit_diff("eager", "oracle"),
            "eager_vs_oracle_kv_diff": kv_diff("eager", "oracle"),
            "greedy_equal": all(bool((a.argmax(-1) == b.argmax(-1)).all())
                                for a, b in zip(logits["oracle"], logits[captured])),
            # the first step alone: before earlier steps' K/V differences feed later ones
            "first_step_vs_oracle_logit_diff": (logits[captured][0] - logits["oracle"][0]).abs().max().item(),
            "first_step_greedy_equal": bool((logits[captured][0].argmax(-1) == logits["oracle"][0].argmax(-1)).all())}


def time_steps(setup: Setup, runner: ModelRunner, batches: list[int], n_tokens: int, reps: int) -> list[dict]:
    """Per batch size: per_sequence, pooled and graph-replayed step times and the floor (ms)."""
    from benchmarks.gpu.gpu_decode import copy_bandwidth, read_weight_bytes

    bandwidth = copy_bandwidth(setup, 1 << 30 if setup.device.type == "cuda" else 64 << 20)
    weights = read_weight_bytes(runner.model)
    s = runner.shape
    rows = []
    for b in batches:
        row = {"batch": b, "tokens": n_tokens, **_time_batch(setup, runner, b, n_tokens, reps)}
        kv = 2 * s.n_layers * s.n_kv_heads * s.head_dim * n_tokens * b * runner.dtype.itemsize
        row.update(weight_bytes=weights, kv_bytes=kv, copy_gb_per_s=round(bandwidth / 1e9, 1),
                   floor_ms=(weights + kv) / bandwidth * 1e3)
        row["graph_over_floor"] = row["graph_ms"] / row["floor_ms"]
        rows.append(row)
        logger.info("steps %s", row)
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _time_batch(setup: Setup, runner: ModelRunner, b: int, n_tokens: int, reps: int) -> dict:
    from blend_engine.executor.decode import pooled_kernel

    pool, runs = pool_runs(runner, b, n_tokens)
    tokens, starts = [7 + i for i in range(b)], [n_tokens] * b

    views = [pool.view(run, n_tokens) for run in runs]  # made once, as the engine loop holds them

    def caches() -> list:  # every step at the same positions (given explicitly: the lengths it set do not matter)
        return views

    row = {"per_sequence_ms": median_ms(lambda: decode_batch(runner, caches(), tokens, starts, "per_sequence"),
                                        setup, reps)}
    for kernel in dict.fromkeys(("gather", pooled_kernel(setup.device))):
        try:
            row[f"pooled_{kernel}_ms"] = median_ms(
                lambda kernel=kernel: decode_batch(runner, caches(), tokens, starts, "pooled", kernel=kernel), setup, reps)
            graphs = DecodeGraphs(runner, pool, capture=setup.device.type == "cuda", kernel=kernel)
            setup.sync()
            t0 = time.perf_counter()
            graphs.step(caches(), tokens, starts)  # the first: captures
            setup.sync()
            row[f"first_capture_{kernel}_ms"] = (time.perf_counter() - t0) * 1e3
            row[f"graph_{kernel}_ms"] = median_ms(lambda graphs=graphs: graphs.step(caches(), tokens, starts), setup, reps)
        except Exception as exc:  # noqa: BLE001 - one kernel failing leaves the other's numbers
            logger.exception("batch %d, %s kernel failed", b, kernel)
            row[f"{kernel}_error"] = repr(exc)[:400]
    row["graph_ms"] = min((v for k, v in row.items() if k.startswith("graph_") and k.endswith("_ms")), default=float("nan"))
    return row


def profile_step(setup: Setup, runner: ModelRunner, b: int, n_tokens: int) -> str:
    """A torch.profiler table (top kernels by device time) of one eager pooled step at batch b: the
    same kernels a graph replays, so where a replayed step's time goes."""
    pool, runs = pool_runs(runner, b, n_tokens)
    tokens, starts = [7 + i for i in range(b)], [n_tokens] * b

    def step() -> None:
        decode_batch(runner, [pool.view(run, n_tokens) for run in runs], tokens, starts, "pooled")

    prof, _ = profiled(setup, step)
    by = "self_cuda_time_total" if setup.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=by, row_limit=15, max_name_column_width=50)


# (keys per step, warps, key ranges per row and head; None: `paged_decode.splits`)
KERNEL_CONFIGS = ((128, 4, None), (128, 4, 1), (64, 4, 1), (64, 2, 1), (128, 8, 1), (64, 4, None))


def time_kernels(setup: Setup, batches: list[int], n_tokens: int, reps: int) -> list[dict]:
    """One layer's decode attention alone on the 8B shape (8 KV heads of 4 query heads, D 128): the
    Triton kernel at each (block, warps, key ranges) of KERNEL_CONFIGS against the gather + SDPA, in
    GB/s of K/V read (the batch's K and V of this layer once)."""
    rows = []
    for b in batches:
        rows.append(_time_kernel_batch(setup, b, n_tokens, reps))
        logger.info("kernel %s", rows[-1])
    return rows


def _time_kernel_batch(setup: Setup, b: int, n_tokens: int, reps: int) -> dict:
    from blend_engine.executor.paged_decode import paged_decode

    h, g, d = 8, 4, 128
    k = torch.randn(h, b * (n_tokens + 64), d, device=setup.device, dtype=setup.dtype)  # [H, slots, D]
    v = torch.randn_like(k)
    q = torch.randn(b, h, g, d, device=setup.device, dtype=setup.dtype)  # [B, H, G, D]
    start = torch.arange(b, device=setup.device) * (n_tokens + 64)  # [B]
    n = torch.full((b,), n_tokens, device=setup.device)  # [B]
    pos = n - 1
    nbytes = 2 * b * h * n_tokens * d * k.element_size()
    row: dict = {"batch": b, "tokens": n_tokens, "kv_mb": nbytes / 1e6}
    keys = (start[:, None] + torch.arange(n_tokens, device=setup.device)[None, :]).reshape(-1)  # [B*T]
    mask = torch.ones(b, 1, 1, n_tokens, dtype=torch.bool, device=setup.device)  # [B, 1, 1, T]

    def gather() -> torch.Tensor:
        kb = k.index_select(1, keys).view(h, b, n_tokens, d).transpose(0, 1)  # [B, H, T, D]
        vb = v.index_select(1, keys).view(h, b, n_tokens, d).transpose(0, 1)  # [B, H, T, D]
        return torch.nn.functional.scaled_dot_product_attention(q, kb, vb, attn_mask=mask)  # [B, H, G, D]

    want = gather()
    row["gather_sdpa_us"] = median_ms(gather, setup, reps) * 1e3
    for block, warps, n_splits in KERNEL_CONFIGS:
        name = f"triton_{block}x{warps}_split{n_splits or 'auto'}"

        def kernel(block: int = block, warps: int = warps, n_splits: int | None = n_splits) -> torch.Tensor:
            return paged_decode(q, k, v, start, n, pos, None, d ** -0.5, block, warps, n_splits)  # [B, H, G, D]

        try:
            row[f"{name}_err"] = (kernel().float() - want.float()).abs().max().item()
            row[f"{name}_us"] = median_ms(kernel, setup, reps) * 1e3
            row[f"{name}_gb_per_s"] = nbytes / (row[f"{name}_us"] / 1e6) / 1e9
        except Exception as exc:  # noqa: BLE001 - one config failing leaves the others
            row[f"{name}_error"] = repr(exc)[:300]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--smollm", type=Path, default=None, help="a gpu_pack folder (default: the local GGUF)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", default="equal,steps,kernel,batched")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from benchmarks.gpu.gpu_check import _runner, _tokenizer
    from benchmarks.gpu.gpu_timing import random_runner

    cuda = torch.cuda.is_available() and not args.smoke
    setup = Setup(torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32, args.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"torch": torch.__version__, "device": str(setup.device)}

    def part(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as exc:  # noqa: BLE001 - a one-shot device check reports what it can
            logger.exception("%s failed", name)
            result[f"{name}_error"] = repr(exc)[:600]
        result[f"{name}_s"] = round(time.perf_counter() - t0, 1)
        (args.out / "decode_graphs.json").write_text(json.dumps(result, indent=2))

    parts = args.only.split(",")
    with torch.inference_mode():
        if "equal" in parts:
            from blend_engine.executor.decode import pooled_kernel

            for dt in dict.fromkeys((torch.float32, setup.dtype)):
                runner = _runner(args.smollm, str(setup.device), dt)
                for kernel in dict.fromkeys(("gather", pooled_kernel(setup.device))):
                    part(f"equal_{str(dt).removeprefix('torch.')}_{kernel}",
                         lambda runner=runner, kernel=kernel: compare_captured_and_eager(runner, kernel=kernel))
        big: list[ModelRunner] = []  # the 8B-shaped random model, built once for the parts that time

        def timing_runner() -> ModelRunner:
            if not big:
                big.append(random_runner(setup, _tokenizer(args.smollm)))
            return big[0]

        if "steps" in parts:
            batches = [1, 4] if args.smoke else [int(b) for b in args.batch.split(",")]
            part("steps", lambda: time_steps(setup, timing_runner(), batches,
                                             256 if args.smoke else args.tokens, 2 if args.smoke else args.reps))
        if "profile" in parts:
            part("profile", lambda: profile_step(setup, timing_runner(), 4 if args.smoke else 64,
                                                 256 if args.smoke else args.tokens))
            print(result.get("profile", ""))
        if "kernel" in parts:
            part("kernel", lambda: time_kernels(setup, [1, 4] if args.smoke else [int(b) for b in args.batch.split(",")],
                                                256 if args.smoke else args.tokens, 2 if args.smoke else 20))
        if "batched" in parts:  # the engine loop's batched run with graphs off / on (gpu_check part 4's setup)
            from benchmarks.gpu.gpu_batch import time_batched

            clients = (4,) if args.smoke else (64,)
            n = 329 if args.smoke else 8192
            for mode in ("off", "auto"):
                gc.collect()  # the last engine's KV pool (most of the device) goes before the next is made
                if setup.device.type == "cuda":
                    torch.cuda.empty_cache()
                part(f"batched_graphs_{mode}", lambda mode=mode: time_batched(setup, timing_runner(), clients, n,
                                                                             decode_graphs=mode))
    print(json.dumps(result, indent=2))
    return 0 if not any(k.endswith("_error") for k in result) else 1


if __name__ == "__main__":
    raise SystemExit(main())
