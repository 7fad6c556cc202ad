"""Why the service has one compute thread (`blend_engine.model.cpu_threads`): the decode step's projections
(SmolLM2-135M's 211 weight shapes, random values, fp32, as `ModelRunner.linear` runs them) timed on
a compute thread, alone and beside idle helper threads that once ran a parallel torch op.

    python -m benchmarks.kernels.cpu_threads [--rows 1,2,8] [--helpers 3] [--reps 7]

Each case runs in a fresh process (OpenMP teams live as long as their threads):
- `alone`: the compute thread is the only one that ever ran torch;
- `helpers, default`: `--helpers` threads each ran a parallel op first, with torch's default thread count
  (a request thread embedding a question, a store reader converting a chunk);
- `helpers, one core`: the same threads after `cpu_threads.one_core()` (what the service does).

Prints ms per pass over the 211 projections and the process's CPU time / wall time while it ran.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import torch

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))  # one layer
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
CASES = ("alone", "helpers, default", "helpers, one core")


def weights() -> list[torch.nn.Linear]:
    layers = [torch.nn.Linear(i, o, bias=False) for _ in range(LAYERS) for o, i in SHAPES]
    return [*layers, torch.nn.Linear(HIDDEN, VOCAB, bias=False)]  # + lm_head


def projections_ms(linears: list[torch.nn.Linear], rows: int, reps: int) -> tuple[float, float]:
    from blend_engine.model.runner import rows_linear

    xs = {n: torch.randn(rows, n) for n in {m.in_features for m in linears}}  # [B, in] each
    with torch.inference_mode():
        for m in linears:
            rows_linear(m, xs[m.in_features])  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reps):
            for m in linears:
                rows_linear(m, xs[m.in_features])  # [B, out]
        wall = time.perf_counter() - t0
    return wall / reps * 1e3, (time.process_time() - c0) / wall


def one_case(case: str, rows: list[int], helpers: int, reps: int) -> dict:
    """Runs in its own process: the case's helper threads, then the compute thread."""
    from blend_engine.model import cpu_threads

    hold = threading.Event()

    def helper() -> None:
        if case == "helpers, one core":
            cpu_threads.one_core()
        torch.ones(1 << 20).sum()  # a parallel op: this thread's team, for as long as it lives
        torch.randn(64, HIDDEN) @ torch.randn(HIDDEN, 1536)
        hold.wait()

    if case != "alone":
        for _ in range(helpers):
            threading.Thread(target=helper, daemon=True).start()
        time.sleep(0.5)
    out: dict = {}

    def compute() -> None:
        cpu_threads.use_cores()
        linears = weights()
        out.update({str(b): projections_ms(linears, b, reps) for b in rows})

    t = threading.Thread(target=compute)
    t.start()
    t.join()
    hold.set()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,8")
    ap.add_argument("--helpers", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # the child process's
    args = ap.parse_args(argv)
    rows = [int(x) for x in args.rows.split(",")]
    if args.case:
        print(json.dumps(one_case(args.case, rows, args.helpers, args.reps)))
        return 0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per pass over the 211 projections "
          f"(CPU time / wall)")
    print("| rows | " + " | ".join(CASES) + " |\n|---|" + "---|" * len(CASES))
    results = {}
    for case in CASES:
        cmd = [sys.executable, "-m", "benchmarks.kernels.cpu_threads", "--case", case, "--rows", args.rows,
               "--helpers", str(args.helpers), "--reps", str(args.reps)]
        results[case] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    for b in rows:
        cells = [f"{results[c][str(b)][0]:.1f} ({results[c][str(b)][1]:.2f})" for c in CASES]
        print(f"| {b} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
