"""Where a decode step's time goes: `torch.profiler` over `decode_batch` at batch sizes B on the
default model (real weights), over runs of one paged pool holding T tokens each (random K/V).

    python -m benchmarks.kernels.decode_profile [--batch 1,8] [--tokens 800] [--steps 5] [--wall] [--dtype D]
        [--linear-dtype bfloat16] [--no-packed]

Prints per B the step's CPU time (sum of the operators' self times, per step), the GEMMs'
(aten::mm / addmm) and the attention calls' (SDPA) share, and the top operators. The profiler
inflates small calls; `--wall` instead times the step by the clock (median of `--steps` after a
warm-up) beside the same B rows through the model's projections alone (`ModelRunner.linear`, as the step
runs them), so the rest (attention, norms, RoPE, Python) is the difference.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu.gpu_common import Setup, median_ms
from benchmarks.kernels.decode_attention import pool_runs
from blend_engine.executor.decode import decode_batch
from blend_engine.model.runner import ModelRunner

GEMM = ("aten::mm", "aten::addmm")


def profile_step(runner: ModelRunner, batch: int, n_tokens: int, steps: int) -> list[str]:
    pool, runs = pool_runs(runner, batch, n_tokens)
    tokens, pos = [7 + b for b in range(batch)], [n_tokens] * batch

    def step() -> None:
        decode_batch(runner, [pool.view(run, n_tokens) for run in runs], tokens, pos)

    with torch.inference_mode():
        for _ in range(3):  # warm-up
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
    ops = prof.key_averages()

    def ms(events) -> float:
        return sum(e.self_cpu_time_total for e in events) / 1e3 / steps

    total = ms(ops)
    gemm = ms(e for e in ops if e.key in GEMM)
    attn = ms(e for e in ops if "scaled_dot_product" in e.key)
    lines = [f"B={batch} T={n_tokens}: step {total:.1f} ms; GEMMs {gemm:.1f} ms, attention {attn:.1f} ms"]
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:6]:
        lines.append(f"    {e.key:50s} {e.self_cpu_time_total / 1e3 / steps:7.1f} ms  {e.count // steps} calls")
    return lines


def step_linears(runner: ModelRunner) -> list[torch.nn.Linear]:
    """A decode step's projections (every layer's and the lm_head), each through `runner.linear`."""
    return [m for m in runner.model.modules() if type(m) is torch.nn.Linear]


def wall_step(runner: ModelRunner, batch: int, n_tokens: int, steps: int) -> str:
    """The step's wall time and its projections' alone, at `batch` rows."""
    pool, runs = pool_runs(runner, batch, n_tokens)
    tokens, pos = [7 + b for b in range(batch)], [n_tokens] * batch
    linears = step_linears(runner)
    xs = {n: torch.randn(batch, n, dtype=runner.dtype, device=runner.device) for n in {m.in_features for m in linears}}

    def step() -> None:
        decode_batch(runner, [pool.view(run, n_tokens) for run in runs], tokens, pos)

    def projections() -> None:
        for m in linears:
            runner.linear(m, xs[m.in_features])  # [B, out]

    with torch.inference_mode():
        setup = Setup(runner.device, runner.dtype, smoke=False)
        total, gemm = median_ms(step, setup, steps), median_ms(projections, setup, steps)
    return (f"B={batch} T={n_tokens}: step {total:.1f} ms wall; its {len(linears)} projections alone "
            f"{gemm:.1f} ms; the rest {total - gemm:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=800)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--wall", action="store_true", help="clock the step against its projections alone")
    ap.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                    help="the model's dtype (default: the device's, float32 on the CPU)")
    ap.add_argument("--linear-dtype", default=None, choices=("bfloat16",),
                    help="the projections' weight copies (BLENDSERVE_MODEL_LINEAR_DTYPE)")
    ap.add_argument("--no-packed", dest="packed", action="store_false",
                    help="float32 weights only (BLENDSERVE_MODEL_PACKED_WEIGHTS=false)")
    args = ap.parse_args(argv)
    runner = ModelRunner.load(dtype=args.dtype, linear_dtype=args.linear_dtype, packed=args.packed)
    for b in (int(x) for x in args.batch.split(",")):
        print(wall_step(runner, b, args.tokens, args.steps) if args.wall
              else "\n".join(profile_step(runner, b, args.tokens, args.steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
