"""One-shot GPU check of the engine (issue 14). Writes gpu_check.json and gpu_check.md.

    python -m benchmarks.gpu_check OUT_DIR [--smollm .gpucarry/smollm2] [--smoke]

(1) correctness on CUDA with SmolLM2-135M (3-bit packed to travel, see `gpu_pack`): blend at
    ratio 1.0 equals full prefill (the same next token unless full prefill's top two are a near-tie
    that kernel rounding may flip; first-token KL within the compute dtype's tolerance:
    `selfcheck.compare`), and full_reuse /
    blend@0.15 run from the memory and the disk tier;
(2) time to first token at 4K / 8K / 16K tokens on a randomly initialised Llama-3.1-8B-shaped
    model (32 layers, 32/8 heads, head dim 128, hidden 4096, FFN 14336, bf16; random weights are
    honest for timing, never for quality): full_prefill, full_reuse and blend@0.15 with the KV in
    pinned RAM, on local disk (page cache warm) and already on the GPU, in the service's own memory
    tier (pinned), its tiered store read from disk (memory tier empty) and its device tier (every
    chunk written through, nothing crosses the bus), blend@auto (the
    controller) from disk, beside transformers' own forward (sdpa) as the peer; at 8K also blend@0.15
    with FlexAttention and with int8 KV; the selected rows' attention kernels alone (`gpu_timing`);
(3) ingestion's KV precompute in 256-token passages per second, one at a time vs batched;
(4) continuous batching on the 8B shape: 1, 16 and 64 concurrent requests, each blending 8K tokens
    and decoding 32 (`gpu_batch`);
(5) one JSON and one markdown table.

`--smoke`: tiny shapes, one length, the local SmolLM2 on the CPU: proves the script end to end.
Only torch, transformers and safetensors are needed (what the H200 image has).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu_batch import time_batched
from benchmarks.gpu_common import QUESTIONS, Setup, kl, make_passages
from benchmarks.gpu_report import markdown
from benchmarks.gpu_timing import random_runner, time_attention, time_ingestion, time_ttft
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.model import ModelRunner
from blend_engine.selfcheck import compare, tolerance
from blend_engine.types import BlendPlan

logger = logging.getLogger("gpu_check")
__all__ = ["check_correctness", "main", "markdown", "run", "time_attention", "time_ingestion", "time_ttft"]


# ============================================================================ (1) correctness
def check_correctness(setup: Setup, smollm: Path | None, tmp: Path) -> dict:
    if smollm is not None:
        from benchmarks.gpu_pack import load_packed

        model, tok = load_packed(smollm, str(setup.device), setup.dtype)
        runner = ModelRunner(model, tok, "smollm2-135m (3-bit packed)")
    else:
        runner = ModelRunner.load(device=str(setup.device), dtype=str(setup.dtype).removeprefix("torch."))
    fmt = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(runner.dtype, "fp16")
    memory = MemoryStore(1 << 30, kv_format=fmt)
    disk = DiskStore(tmp / "smol", 1 << 30, kv_format=fmt)
    rows = []
    for tier, store, depth in (("memory", memory, 0), ("disk", disk, 2)):
        engine = BlendEngine(runner, store, EngineConfig(kv_format=fmt), loader=LayerLoader(store, depth))
        passages = make_passages(engine, 600 if setup.smoke else 2048, seed=1)
        for p in passages:
            engine.ensure_cached(p)
        for question in QUESTIONS[:1] if setup.smoke else QUESTIONS:
            full = engine.prefill(BlendPlan(tuple(passages), question, mode="full_prefill")).logits
            one = engine.prefill(BlendPlan(tuple(passages), question, mode="blend", recompute_ratio=1.0)).logits
            reuse = engine.prefill(BlendPlan(tuple(passages), question, mode="full_reuse")).logits
            blend = engine.prefill(BlendPlan(tuple(passages), question, mode="blend", recompute_ratio=0.15)).logits
            verdict = compare(full, one, runner.dtype)  # blend@1.0 vs full prefill: the dtype's tolerance
            rows.append({"tier": tier, "question": question, "same_argmax": verdict.same_top1,
                         "top1_agrees": verdict.top1_agrees, "near_tie": verdict.near_tie, "top2_gap": verdict.margin,
                         "kl_ratio1": verdict.kl, "kl_ok": verdict.kl_ok, "kl_full_reuse": kl(full, reuse),
                         "kl_blend015": kl(one, blend)})  # blend@0.15 against its same-kernel reference
    ok = all(r["top1_agrees"] and r["kl_ok"] for r in rows)
    tol = tolerance(runner.dtype)
    return {"model": runner.name, "dtype": str(runner.dtype), "kv_format": fmt, "rows": rows, "pass": ok,
            "kl_tolerance": tol.kl, "tie_ulps": tol.tie_ulps}


def run(out: Path, smoke: bool, smollm: Path | None, lengths: list[int], reps: int) -> dict:
    import transformers

    cuda = torch.cuda.is_available() and not smoke
    setup = Setup(torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32, smoke)
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device_name": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or 'cpu'})",
           "smoke": smoke}
    result: dict = {"environment": env, "reps": reps}
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part: a run stopped by its time limit keeps what it measured
        result["seconds"] = time.perf_counter() - t0
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
        (out / "gpu_check.md").write_text(markdown(result))

    def part(name: str, fn: Callable[[], object]) -> object | None:
        """One part; a failure is recorded (with its traceback) and the next part still runs."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a one-shot run reports every part it can
            logger.exception("%s failed", name)
            result.setdefault("errors", {})[name] = "".join(traceback.format_exception(exc))[-4000:]
            return None
        finally:
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
            save()

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp_name:
        tmp = Path(tmp_name)
        correctness = part("correctness", lambda: check_correctness(setup, smollm, tmp))
        result["correctness"] = correctness or {"model": "-", "dtype": "-", "kv_format": "-", "rows": [],
                                                "pass": False}
        save()
        logger.info("correctness: %s (%.0f s)", result["correctness"]["pass"], time.perf_counter() - t0)
        runner = part("timing model", lambda: random_runner(setup, _tokenizer(smollm)))
        result["ttft"] = {"rows": []}
        if runner is None:  # recorded under errors; nothing below can run without it
            return result
        result["timing_model"] = runner.name + f", {runner.dtype}"
        for n in lengths:
            variants = n == lengths[len(lengths) // 2]  # flex and int8 at the middle length (8K): time is short
            row = part(f"ttft {n}", lambda n=n, v=variants: time_ttft(setup, runner, n, tmp, reps, v))
            if row is not None:
                result["ttft"]["rows"].append(row)
        logger.info("ttft done (%.0f s)", time.perf_counter() - t0)
        result["attention"] = [a for n in lengths
                               if (a := part(f"attention {n}", lambda n=n: time_attention(setup, n, 0.15, reps)))]
        save()
        result["ingestion"] = part("ingestion", lambda: time_ingestion(setup, runner, 8 if smoke else 256,
                                                                       8 if smoke else 32))
        save()
        result["batched"] = part("batched", lambda: time_batched(setup, runner, (1, 2, 4) if smoke else (1, 16, 64),
                                                                 512 if smoke else 8192, 8 if smoke else 32))
        save()
    return result


def _tokenizer(smollm: Path | None):
    if smollm is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(smollm)
    return ModelRunner.load().tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="?", default=Path("benchmarks/results/gpu"))
    ap.add_argument("--smollm", type=Path, default=None, help="a gpu_pack folder (default: the local GGUF)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one length, CPU: the script end to end")
    ap.add_argument("--lengths", default="4096,8192,16384")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    lengths = [512] if args.smoke else [int(x) for x in args.lengths.split(",")]
    result = run(args.out, args.smoke, args.smollm, lengths, 1 if args.smoke else args.reps)
    print(markdown(result))  # noqa: T201 - a CLI's report
    return 0 if result["correctness"]["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
