"""Where Blendserve's prefill time goes on one peer_vllm prompt (issue #37: "measure why"): a
torch.profiler table of one cold blend (every passage a miss), one cold full prefill and one
reordered blend (every passage a hit) of the same RAG prompt,
in-process (`BlendEngine.prefill`, fp32, the service's defaults, automatic prefix caching off so
that neither takes the other's KV), ops summed by self CPU time into matmul / attention /
the rest, beside the wall time. Not part of `make test`.

    .venv/bin/python -m benchmarks.peers.peer_vllm_profile [--size 4000] [--dataset hotpotqa] [--threads 2]

Writes benchmarks/results/peer_vllm/profile_<size>.json and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.peers.peer_vllm import ExamplePool, rag_prompt
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, Mode

logger = logging.getLogger(__name__)
OUT = Path(__file__).resolve().parents[1] / "results" / "peer_vllm"
GROUPS: dict[str, tuple[str, ...]] = {  # op name fragments, first match wins (the C++ kernels' ops too)
    "attention": ("scaled_dot_product", "flash_attention", "_softmax", "bmm", "baddbmm", "selected_attention",
                  "paged_decode"),
    "matmul (linear layers)": ("addmm", "aten::mm", "linear", "matmul"),
    "copies and indexing": ("copy_", "index", "cat", "stack", "clone", "contiguous", "gather", "scatter",
                            "place_rotated"),
    "elementwise and norms": ("mul", "add", "sub", "div", "silu", "rsqrt", "pow", "mean", "neg", "exp", "rms_norm",
                              "rope"),
}


def group_of(name: str) -> str:
    for group, parts in GROUPS.items():
        if any(p in name for p in parts):
            return group
    return "other ops"


def op_table(prof: profile, top: int = 12) -> dict[str, Any]:
    """Self CPU ms per op group and the `top` ops; the sum of self times counts every op once."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    groups: dict[str, float] = {}
    for e in events:
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total / 1e3
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"self_cpu_ms_by_group": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top_ops": [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in ops]}


def profiled(fn: Callable[[], Any]) -> tuple[float, dict[str, Any]]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    return wall * 1e3, op_table(prof)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    runner = ModelRunner.load("default", device="cpu", dtype="float32")
    prompt = rag_prompt(ExamplePool([args.dataset]), args.dataset, args.size, runner.tokenizer)
    engine = BlendEngine(runner, MemoryStore(4 << 30), EngineConfig(prefix_caching=False))
    out: dict[str, Any] = {"size": args.size, "dataset": args.dataset, "prompt_tokens": len(prompt.ids),
                           "passages": len(prompt.passages), "threads": args.threads,
                           "load_avg_at_start": os.getloadavg()}

    def measure(name: str, plan: BlendPlan) -> None:
        wall_ms, table = profiled(lambda: engine.prefill(plan, max_new_tokens=1))
        out[name] = {"wall_ms": wall_ms, "load_avg_1m": os.getloadavg()[0], **table}
        logger.info("%s: %.0f ms wall", name, wall_ms)

    try:
        measure("blend (cold, every passage a miss)", BlendPlan(prompt.passages, prompt.question, numbered=True))
        measure("full_prefill (cold)", BlendPlan(prompt.passages, prompt.question, Mode.FULL_PREFILL, numbered=True))
        t0 = time.perf_counter()
        for passage in prompt.passages:  # their alone-KV, as the benchmark's cold blend stores it (in the background)
            engine.ensure_cached(passage)
        out["store_passages_ms"] = (time.perf_counter() - t0) * 1e3
        measure("blend (reordered, every passage a hit)", BlendPlan(prompt.reordered, prompt.question, numbered=True))
        return out
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.peer_vllm_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=4000)
    p.add_argument("--dataset", default="hotpotqa", choices=("musique", "hotpotqa"))
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = run(args)
    path = OUT / f"profile_{args.size}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
