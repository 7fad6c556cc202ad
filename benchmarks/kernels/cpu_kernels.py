"""Blendserve's CPU kernels (`blend_engine.model.cpu_kernels`) against torch's at the engine's shapes.

    python -m benchmarks.kernels.cpu_kernels [--rows 1,2,4,8,16,32,64,128,256] [--repeat 7]

- projections: the default model's 211 projections of one decode step (every layer's q, k, v, o,
  gate, up, down and the lm_head, real weights) at T rows, through `runner.rows_linear` as it runs
  without the kernel (MKL: W @ x^T on padded rows up to 96, nn.Linear beyond) and through
  `cpu_kernels.rows_linear`; the kernel is used for `cpu_kernels.ROWS`.
- decode attention: see `python -m benchmarks.kernels.decode_attention` (per-sequence SDPA, the pool read in
  place, the gather).

Per path, the mean of two medians of --repeat (each after a warm-up), the two paths taking turns; both on
the calling thread's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch

from benchmarks.gpu.gpu_common import Setup, median_ms
from benchmarks.kernels.decode_profile import step_linears
from blend_engine.model import cpu_kernels
from blend_engine.model.runner import ModelRunner, rows_linear


@contextlib.contextmanager
def without_kernel():
    """`runner.rows_linear` as it runs where the kernel is not built (MKL)."""
    rows = cpu_kernels.ROWS
    cpu_kernels.ROWS = range(0)
    try:
        yield
    finally:
        cpu_kernels.ROWS = rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    if not cpu_kernels.ensure():
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_kernels.why_not()}")
    runner = ModelRunner.load()
    layers = step_linears(runner)
    setup = Setup(runner.device, runner.dtype, smoke=False)
    rows_out = []
    with torch.inference_mode():
        for t in (int(r) for r in args.rows.split(",")):
            xs = {n: torch.randn(t, n) for n in {layer.in_features for layer in layers}}

            def mkl(xs=xs) -> None:
                with without_kernel():
                    for layer in layers:
                        rows_linear(layer, xs[layer.in_features])

            def kernel(xs=xs) -> None:
                for layer in layers:
                    cpu_kernels.rows_linear(xs[layer.in_features], layer.weight, layer.bias)

            a, b = [], []
            for _ in range(2):  # taking turns
                a.append(median_ms(mkl, setup, args.repeat))
                b.append(median_ms(kernel, setup, args.repeat))
            row = {"rows": t, "mkl_ms": round(statistics.mean(a), 1), "kernel_ms": round(statistics.mean(b), 1),
                   "kernel_used": t in cpu_kernels.ROWS}
            rows_out.append(row)
            print(f"{len(layers)} projections at {t} rows: MKL {row['mkl_ms']} ms, kernel {row['kernel_ms']} ms "
                  f"({row['kernel_ms'] / row['mkl_ms']:.2f}x){'' if row['kernel_used'] else '  (not used here)'}")
    print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows_out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
