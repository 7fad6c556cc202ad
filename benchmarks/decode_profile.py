"""Where a decode step's time goes: `torch.profiler` over `decode_batch` at batch sizes B on the
default model (real weights), over runs of one paged pool holding T tokens each (random K/V).

    python -m benchmarks.decode_profile [--batch 1,8] [--tokens 800] [--steps 5]

Prints per B the step's CPU time (sum of the operators' self times, per step), the GEMMs'
(aten::mm / addmm) and the attention calls' (SDPA) share, and the top operators.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode_attention import pool_runs
from blend_engine.executor.decode import decode_batch
from blend_engine.model import ModelRunner

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=800)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    runner = ModelRunner.load()
    for b in (int(x) for x in args.batch.split(",")):
        print("\n".join(profile_step(runner, b, args.tokens, args.steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
