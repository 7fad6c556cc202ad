"""Automatic prefix caching through the engine loop: time to first token of one RAG prompt cold,
again with its passages in the same order (the pool's prefix cache), and with the passages
reversed (blend over the chunk store), per mode, on the default model (SmolLM2-135M, fp32, CPU).

    python -m benchmarks.ttft.repeat [--questions 3] [--passages 20]

The passages' alone-KV is stored first (ingestion), so "cold" means: nothing of this prompt is in
the KV pool. Prints one row per question and mode, and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common.data import load_examples, passages_of
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig, Mode

ONE = GenerationConfig(max_tokens=1)


def _ttft(engine: BlendEngine, plan: BlendPlan) -> tuple[float, int]:
    t0 = time.perf_counter()
    result = engine.run(plan, ONE)
    return (time.perf_counter() - t0) * 1e3, result.report.prefix_tokens_reused


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ttft.repeat", description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--passages", type=int, default=20)
    p.add_argument("--modes", default="blend,full_prefill")
    args = p.parse_args(argv)
    runner = ModelRunner.load()
    engine = BlendEngine(runner, MemoryStore(4 << 30), EngineConfig())
    rows: dict[str, list[tuple[float, float, float]]] = {}
    try:
        for ex in load_examples("musique", args.questions):
            passages = passages_of(ex, args.passages)
            for text in passages:
                engine.ensure_cached(text)
            n = engine.layout(BlendPlan(passages, ex.question)).n_tokens
            for mode in (Mode(m) for m in args.modes.split(",")):
                cold, _ = _ttft(engine, BlendPlan(passages, ex.question, mode=mode))
                again, hit = _ttft(engine, BlendPlan(passages, ex.question, mode=mode))
                other, _ = _ttft(engine, BlendPlan(tuple(reversed(passages)), ex.question, mode=mode))
                rows.setdefault(mode.value, []).append((cold, again, other))
                print(f"{ex.id[:24]:24} {n:5d} tokens {mode.value:12} cold {cold:7.0f} ms  same order {again:6.0f} ms "
                      f"(prefix {hit} tokens)  reversed {other:7.0f} ms", flush=True)
    finally:
        engine.close()
    for mode, vals in rows.items():
        med = [statistics.median(v[i] for v in vals) for i in range(3)]
        print(f"median {mode:12} cold {med[0]:7.0f} ms  same order {med[1]:6.0f} ms  reversed {med[2]:7.0f} ms")


if __name__ == "__main__":
    main()
