"""The decode step's attention paths side by side (`executor.decode`): one SDPA call per sequence
(per_sequence) against one call a layer over the paged pool (pooled), with the kernel
`pooled_kernel` picks here (in place: "cpu" or "triton") and with keys gathered for one SDPA call
("gather"), at batch sizes B over contexts of T tokens, on the default model (SmolLM2-135M, its
real shape and weights; on a GPU when there is one).

    python -m benchmarks.kernels.decode_attention [--batch 1,8,16] [--tokens 1024] [--repeat 5]

Prints per B: the median step time of each path, and the pooled one's ratio to per_sequence; the
runs are a pool's views filled with random K/V (timing does not depend on the values). Writes JSON
to --out when given.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from blend_engine.executor.decode import decode_batch, pooled_kernel
from blend_engine.executor.kv_pool import KVPool
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.kv_blocks import Run, blocks_for

logger = logging.getLogger(__name__)


def sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def pool_runs(runner: ModelRunner, batch: int, n_tokens: int, block_tokens: int = 16):
    """`batch` runs of one pool, each holding `n_tokens` tokens of random K/V, room for 64 more."""
    per = blocks_for(n_tokens + 64, block_tokens)
    pool = KVPool(runner, per * batch, block_tokens)
    for k, v in zip(*pool.kv):
        k.normal_()
        v.normal_()
    return pool, [Run(i * per, per) for i in range(batch)]


def step_ms(runner: ModelRunner, batch: int, n_tokens: int, attention: str, repeat: int,
            kernel: str | None = None) -> float:
    pool, runs = pool_runs(runner, batch, n_tokens)
    tokens, starts = [7 + b for b in range(batch)], [n_tokens] * batch
    times = []
    for i in range(repeat + 1):
        caches = [pool.view(run, n_tokens) for run in runs]
        sync(runner)
        t0 = time.perf_counter()
        decode_batch(runner, caches, tokens, starts, attention=attention, kernel=kernel)
        sync(runner)
        if i:  # the first is a warm-up
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = step_parser(__doc__, repeat=5).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runner = ModelRunner.load()
    rows = []
    kernel = pooled_kernel(runner.device, runner.dtype)
    with torch.inference_mode():
        for b in (int(x) for x in args.batch.split(",")):
            per_seq = step_ms(runner, b, args.tokens, "per_sequence", args.repeat)
            pooled = step_ms(runner, b, args.tokens, "pooled", args.repeat, kernel)
            row = {"batch": b, "tokens": args.tokens, "per_sequence_ms": round(per_seq, 2), "pooled_kernel": kernel,
                   "pooled_ms": round(pooled, 2), "pooled_over_per_sequence": round(pooled / per_seq, 3)}
            line = f"B={b} T={args.tokens}: per_sequence {per_seq:.1f} ms, pooled ({kernel}) {pooled:.1f} ms " \
                   f"({pooled / per_seq:.2f}x)"
            if kernel != "gather":
                row["gather_ms"] = round(step_ms(runner, b, args.tokens, "pooled", args.repeat, "gather"), 2)
                line += f", gather {row['gather_ms']:.1f} ms"
            rows.append(row)
            logger.info("%s", line)
    result = with_machine(runner, rows)
    print(json.dumps(result, indent=2))
    write_json(args.out, result)
    return 0


def step_parser(doc: str | None, repeat: int) -> argparse.ArgumentParser:
    """The step benchmarks' common arguments: --batch, --tokens, --repeat, --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,16")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--out", type=Path, default=None)
    return ap


def with_machine(runner: ModelRunner, rows: list[dict]) -> dict:
    """A benchmark's rows with the device, dtype, model, torch and thread count they ran on."""
    return {"device": str(runner.device), "dtype": str(runner.dtype), "model": runner.name,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}


def write_json(path: Path | None, result: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
