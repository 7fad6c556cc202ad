"""A prefill's attention on the CPU, path by path (`executor.selection.cpu_kernel`): the C++ kernel
(`cpu_kernels.selected_attention`, "auto") against SDPA in position-ordered blocks ("blocks", the CPU's
path before it) for a blend's selected rows, and against one causal SDPA call for every row (a full
prefill, a blend's layers below its check layer), at the default model's heads over N keys.

    python -m benchmarks.kernels.prefill_attention [--tokens 4600] [--fractions 0.15,0.3,0.6] [--repeat 5]

Selected rows: a seeded random `fraction` of the positions plus the last 32 (the question), sorted,
attending to the keys before them. Prints per case, for each path, the mean of two medians of --repeat
(each after a warm-up), the two paths taking turns as in `benchmarks.kernels.cpu_kernels`, and the rate in (row,
visible key) cells per second; random Q/K/V (timing does not depend on the values); the outputs are
compared (max abs difference).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.gpu.gpu_common import Setup, median_ms
from blend_engine.executor.selection import Selection
from blend_engine.model import cpu_kernels
from blend_engine.model.runner import ModelRunner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4600)
    ap.add_argument("--fractions", default="0.15,0.3,0.6")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if not cpu_kernels.ensure():
        raise SystemExit(f"the CPU kernels are unavailable: {cpu_kernels.why_not()}")
    runner = ModelRunner.load()
    setup = Setup(runner.device, runner.dtype, smoke=False)
    s, n = runner.shape, args.tokens
    hq, h, d = s.n_heads, s.n_kv_heads, s.head_dim
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(h, n, d, generator=g), torch.randn(h, n, d, generator=g)  # [H, N, D]
    cos, sin = runner.rope(torch.arange(n))  # [N, D]: only their shape and dtype matter here
    cases = []
    with torch.inference_mode():
        for frac in (float(f) for f in args.fractions.split(",")):
            picked = torch.randperm(n - 32, generator=g)[:int(frac * (n - 32))]
            pos = torch.cat([picked, torch.arange(n - 32, n)]).sort().values  # [S]
            cases.append((f"{frac:.0%} of the rows", pos))
        cases.append(("every row (causal)", torch.arange(n)))
        out = []
        for name, pos in cases:
            q = torch.randn(hq, pos.numel(), d, generator=g)  # [Hq, S, D]
            if pos.numel() == n:
                def torch_path(q=q):
                    return runner.attend(q, k, v, None, causal=True)  # [N, Hq*D]
            else:
                blocks = Selection(pos, cos, sin, n, runner.window_masks, attention="blocks")

                def torch_path(q=q, blocks=blocks):
                    return blocks.attend(runner, q, k, v, 0)  # [S, Hq*D]

            def kernel_path(q=q, pos=pos):
                return cpu_kernels.selected_attention(q, k, v, pos, None, runner.scaling)  # [S, Hq*D]

            diff = (torch_path() - kernel_path()).abs().max().item()
            a, b = [], []
            for _ in range(2):  # taking turns
                a.append(median_ms(torch_path, setup, args.repeat))
                b.append(median_ms(kernel_path, setup, args.repeat))
            sdpa_ms, kernel_ms, cells = statistics.mean(a), statistics.mean(b), float((pos + 1).sum())
            row = {"case": name, "rows": pos.numel(), "keys": n, "sdpa_ms": round(sdpa_ms, 1),
                   "kernel_ms": round(kernel_ms, 1), "sdpa_mcells_s": round(cells / sdpa_ms / 1e3, 1),
                   "kernel_mcells_s": round(cells / kernel_ms / 1e3, 1), "max_abs_diff": diff}
            out.append(row)
            print(f"{name}: {row['rows']} rows over {n} keys: SDPA {row['sdpa_ms']} ms ({row['sdpa_mcells_s']} M cells/s), "
                  f"kernel {row['kernel_ms']} ms ({row['kernel_mcells_s']} M cells/s), {sdpa_ms / kernel_ms:.2f}x; "
                  f"max |diff| {diff:.1e}")
    print(json.dumps({"threads": torch.get_num_threads(), "heads": [hq, h, d], "cases": out}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
