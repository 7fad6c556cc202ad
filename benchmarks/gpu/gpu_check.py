"""One-shot GPU check of the engine (issue 14). Writes gpu_check.json and gpu_check.md.

    python -m benchmarks.gpu.gpu_check OUT_DIR [--smollm .gpucarry/smollm2] [--smoke]

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
(5) the decode step against its bandwidth floor (`gpu_decode`);
(6) a torch.profiler trace (CPU + CUDA activity) of one blend@0.15 at the headline length from each
    KV tier of (2) and of one batched run (4 concurrent requests decoding 8), each after a warm-up:
    top kernels, launch count, device busy time against the wall and the idle gaps between kernels
    (`gpu_traces`, summarised by `gpu_profile`); the chrome traces gzipped in one tar;
(7) one JSON and one markdown table.

`--smoke`: tiny shapes, one length, the local SmolLM2 on the CPU: proves the script end to end.
Only torch, transformers and safetensors are needed (what the H200 image has).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu.gpu_batch import time_batched
from benchmarks.gpu.gpu_common import QUESTIONS, Setup, kl, make_passages
from benchmarks.gpu.gpu_decode import time_decode_floor
from benchmarks.gpu.gpu_preflight import truncated
from benchmarks.gpu.gpu_report import markdown
from benchmarks.gpu.gpu_timing import random_runner, time_attention, time_ingestion, time_ttft
from benchmarks.gpu.gpu_traces import profile_runs
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.model.runner import ModelRunner
from blend_engine.selfcheck import compare, tolerance
from blend_engine.types import BlendPlan

logger = logging.getLogger("gpu_check")
__all__ = ["check_correctness", "main", "markdown", "run", "time_attention", "time_ingestion", "time_ttft"]


# ============================================================================ (1) correctness
FP32_SPREAD = 2.0  # blend@1.0 may be this many times farther from the fp32 answer than full prefill is


def check_correctness(setup: Setup, smollm: Path | None, tmp: Path) -> dict:
    """Blend@1.0 against full prefill per tier and question. A row passes when blend@1.0 picks full
    prefill's token (or the other of a near-tie) and its KL is within the compute dtype's bound, or,
    beyond that bound, when it is no farther from the exact answer (full prefill in fp32, same
    weights) than `FP32_SPREAD` x full prefill's own distance to it: the dtype's rounding, not the
    engine, made the difference."""
    runner = _runner(smollm, str(setup.device), setup.dtype)
    fmt = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(runner.dtype, "fp16")
    questions = QUESTIONS[:1] if setup.smoke else QUESTIONS
    passages = make_passages(BlendEngine(runner, MemoryStore(1 << 20)), 600 if setup.smoke else 2048, seed=1)
    exact = _exact_logits(setup, smollm, passages, questions)
    memory = MemoryStore(1 << 30, kv_format=fmt)
    disk = DiskStore(tmp / "smol", 1 << 30, kv_format=fmt)
    rows = []
    for tier, store, depth in (("memory", memory, 0), ("disk", disk, 2)):
        engine = BlendEngine(runner, store, EngineConfig(kv_format=fmt), loader=LayerLoader(store, depth))
        for p in passages:
            engine.ensure_cached(p)
        for question in questions:
            rows.append(_correctness_row(engine, tier, passages, question, exact.get(question)))
    ok = all(r["pass"] for r in rows)
    tol = tolerance(runner.dtype)
    return {"model": runner.name, "dtype": str(runner.dtype), "kv_format": fmt, "rows": rows, "pass": ok,
            "kl_tolerance": tol.kl, "tie_ulps": tol.tie_ulps}


def _exact_logits(setup: Setup, smollm: Path | None, passages: list[str], questions) -> dict[str, torch.Tensor]:
    """Full prefill's first-token logits [V] in fp32 (the same weights): the exact answer, or {} when
    the check already runs in fp32."""
    if setup.dtype == torch.float32:
        return {}
    runner = _runner(smollm, str(setup.device), torch.float32)
    engine = BlendEngine(runner, MemoryStore(1 << 20, kv_format="fp32"), EngineConfig(kv_format="fp32"))
    out = {q: engine.prefill(BlendPlan(tuple(passages), q, mode="full_prefill")).logits.float() for q in questions}
    del engine, runner
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _correctness_row(engine: BlendEngine, tier: str, passages: list[str], question: str,
                     exact: torch.Tensor | None) -> dict:
    def logits(mode: str, ratio: float | None = None) -> torch.Tensor:
        return engine.prefill(BlendPlan(tuple(passages), question, mode=mode, recompute_ratio=ratio)).logits  # [V]

    full, one = logits("full_prefill"), logits("blend", 1.0)
    reuse, blend = logits("full_reuse"), logits("blend", 0.15)
    verdict = compare(full, one, engine.runner.dtype)  # blend@1.0 vs full prefill: the dtype's tolerance
    row = {"tier": tier, "question": question, "same_argmax": verdict.same_top1, "top1_agrees": verdict.top1_agrees,
           "near_tie": verdict.near_tie, "top2_gap": verdict.margin, "kl_ratio1": verdict.kl, "kl_ok": verdict.kl_ok,
           "kl_full_reuse": kl(full, reuse), "kl_blend015": kl(one, blend)}  # blend@0.15 against its same-kernel reference
    within = verdict.kl_ok
    if exact is not None:
        row["kl_full_vs_fp32"], row["kl_ratio1_vs_fp32"] = kl(exact, full), kl(exact, one)
        within = within or row["kl_ratio1_vs_fp32"] <= FP32_SPREAD * row["kl_full_vs_fp32"] + 1e-4
    row["pass"] = verdict.top1_agrees and within
    return row


# Seconds each part needs on an H200 (estimates; a part starts only while its estimate fits in what is
# left of the budget, so a slow start drops the extras, never the core). Order = priority.
CORE = ("preflight", "correctness", "timing model", "ttft", "batched", "decode")
ESTIMATE_S = {"correctness": 40, "timing model": 20, "ttft": 90, "batched": 90, "decode": 20, "profile": 45,
              "attention": 20, "ingestion": 40, "ttft extra": 60}
BUDGET_S = 420.0  # the check's own limit; gpu_check.sh's `timeout 470` is the hard stop behind it
_START = time.perf_counter()  # the budget counts the interpreter's imports too (a slow start)


class Plan:
    """The check's time plan: what is left of the budget, and whether a part still fits."""

    def __init__(self, budget_s: float, result: dict) -> None:
        self.budget_s, self.result = budget_s, result

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - _START)

    def fits(self, name: str, kind: str | None = None) -> bool:
        need = ESTIMATE_S.get(kind or name, 0)
        if self.left() >= need:
            return True
        self.result.setdefault("skipped", {})[name] = f"time: {self.left():.0f} s left of {self.budget_s:.0f}, needs ~{need} s"
        logger.warning("skipping %s: %s", name, self.result["skipped"][name])
        return False


def run(out: Path, smoke: bool, smollm: Path | None, lengths: list[int], reps: int,
        dtype: torch.dtype | None = None, budget_s: float | None = None) -> dict:
    """The whole check, in priority order (`CORE` first, then the extras while time is left); the JSON
    and markdown rewritten after every part. The first length is the headline (8K): its row has the
    variants, the batched run and the decode floor use it; the other lengths are extras. `budget_s`
    None: no time plan in smoke mode (every part runs), BUDGET_S otherwise."""
    import transformers

    if budget_s is None:
        budget_s = float("inf") if smoke else BUDGET_S

    cuda = torch.cuda.is_available() and not smoke
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    setup = Setup(torch.device("cuda" if cuda else "cpu"), dtype, smoke)
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device_name": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or 'cpu'})",
           "smoke": smoke, "dtype": str(dtype)}
    result: dict = {"environment": env, "reps": reps, "budget_s": budget_s if math.isfinite(budget_s) else None}
    plan = Plan(budget_s, result)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part: a run stopped by its time limit keeps what it measured
        result["seconds"] = time.perf_counter() - _START
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
        (out / "gpu_check.md").write_text(markdown(result))

    def part(name: str, fn: Callable[[], object]) -> object | None:
        """One part; a failure is recorded (with its traceback) and the next part still runs."""
        logger.info("part %s (%.0f s left)", name, plan.left())
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

    result["correctness"] = {"model": "-", "dtype": "-", "kv_format": "-", "rows": [], "pass": False}
    preflight = _preflight(setup, smollm, result)
    save()
    if not preflight:
        return result
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp_name:
        tmp = Path(tmp_name)
        if plan.fits("correctness"):
            result["correctness"] = part("correctness", lambda: check_correctness(setup, smollm, tmp)) or \
                result["correctness"]
        runner = part("timing model", lambda: random_runner(setup, _tokenizer(smollm))) \
            if plan.fits("timing model") else None
        result["ttft"] = {"rows": []}
        if runner is None:  # recorded under errors (or skipped); nothing below can run without it
            return result
        result["timing_model"] = runner.name + f", {runner.dtype}"
        head, extra = lengths[0], lengths[1:]
        _ttft(part, plan, result, setup, runner, head, tmp, reps, variants=True)
        if plan.fits("batched"):
            result["batched"] = part("batched", lambda: time_batched(setup, runner, (1, 2, 4) if smoke else (1, 16, 64),
                                                                     head, 8 if smoke else 32))
        if plan.fits("decode"):
            result["decode"] = part("decode", lambda: time_decode_floor(setup, runner, head, max(reps, 3)))
        if plan.fits("profile"):
            result["profile"] = part("profile", lambda: profile_runs(setup, runner, head, tmp, out))
        if plan.fits("attention"):
            result["attention"] = [a for a in [part(f"attention {head}", lambda: time_attention(setup, head, 0.15, reps))] if a]
        if plan.fits("ingestion"):
            result["ingestion"] = part("ingestion", lambda: time_ingestion(setup, runner, 8 if smoke else 256,
                                                                           8 if smoke else 32))
        for n in extra:
            if plan.fits(f"ttft {n}", "ttft extra"):
                _ttft(part, plan, result, setup, runner, n, tmp, reps, variants=False)
        save()
    return result


def _ttft(part, plan: Plan, result: dict, setup: Setup, runner: ModelRunner, n: int, tmp: Path, reps: int,
          variants: bool) -> None:
    if variants and not plan.fits(f"ttft {n}", "ttft"):
        return
    row = part(f"ttft {n}", lambda: time_ttft(setup, runner, n, tmp, reps, variants))
    if row is not None:
        result["ttft"]["rows"].append(row)


def _preflight(setup: Setup, smollm: Path | None, result: dict) -> bool:
    """The 60-second preflight; on failure its one-line reason is logged, recorded and the run stops."""
    from benchmarks.gpu.gpu_preflight import PreflightFailed, run_preflight

    try:
        result["preflight"] = run_preflight(setup, lambda device, dtype, layers: _runner(smollm, device, dtype, layers))
    except PreflightFailed as exc:
        result["preflight"] = getattr(exc, "report", {"pass": False, "reason": str(exc)})
        logger.error("PREFLIGHT FAILED: %s", exc)
        return False
    logger.info("preflight passed in %.1f s", result["preflight"]["seconds"])
    return True


def _runner(smollm: Path | None, device: str, dtype: torch.dtype, layers: int | None = None) -> ModelRunner:
    """The real model (the carried SmolLM2, else the local GGUF) on `device` in `dtype`; `layers`: its
    first that many layers only (the preflight)."""
    if smollm is not None:
        from benchmarks.gpu.gpu_pack import load_packed

        model, tok = load_packed(smollm, device, dtype, layers)
        return ModelRunner(model, tok, "smollm2-135m (3-bit packed)")
    runner = ModelRunner.load(device=device, dtype=str(dtype).removeprefix("torch."))
    return truncated(runner, layers) if layers is not None else runner


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
    ap.add_argument("--lengths", default="8192,4096,16384",
                    help="the first is the headline (variants, batched run, decode floor); the others run while time is left")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="compute dtype (default bfloat16 on CUDA, float32 on the CPU; the rehearsal uses bfloat16)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"the time plan's budget (default {BUDGET_S:.0f} s; none with --smoke: every part runs)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when any part raised (the rehearsal's drift check)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    lengths = [512] if args.smoke else [int(x) for x in args.lengths.split(",")]
    result = run(args.out, args.smoke, args.smollm, lengths, 1 if args.smoke else args.reps,
                 DTYPES[args.dtype] if args.dtype else None,
                 args.budget_s)
    print(markdown(result))  # noqa: T201 - a CLI's report
    return exit_code(result, args.strict)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def exit_code(result: dict, strict: bool) -> int:
    """3: the preflight failed (its one-line reason printed last); 1: correctness failed, or with
    `strict` any part raised; else 0."""
    if not result.get("preflight", {}).get("pass", True):
        sys.stderr.write(f"gpu_check: preflight failed: {result['preflight'].get('reason')}\n")
        return 3
    if not result["correctness"]["pass"]:
        return 1
    if strict and result.get("errors"):
        sys.stderr.write(f"gpu_check: parts raised: {', '.join(result['errors'])}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
