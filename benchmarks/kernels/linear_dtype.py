"""`BLENDSERVE_MODEL_LINEAR_DTYPE=bfloat16` against float32 on real questions: the first token's
distribution (KL(float32 || bf16 weights)), greedy answers equal, and the time to first token, for
full prefill and blend, on the default model (SmolLM2-135M, fp32, CPU).

    python -m benchmarks.kernels.linear_dtype [--questions 10] [--passages 10] [--dataset musique] [--max-tokens 16]

Both runners share one model (the bf16 copies sit beside its weights) and one chunk store (stored
passages come from transformers' float32 forward under either setting). Refused, like the setting,
on a CPU without native bf16 matmuls.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common.data import load_examples, passages_of
from benchmarks.common.scoring import kl
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model.files import pick_linear_dtype
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig, Mode


def ttft_ms(engine: BlendEngine, plan: BlendPlan) -> float:
    t0 = time.perf_counter()
    engine.run(plan, GenerationConfig(max_tokens=1))
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.linear_dtype", description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--passages", type=int, default=10)
    p.add_argument("--dataset", default="musique", choices=("musique", "hotpotqa"))
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    ref = ModelRunner.load()
    low = ModelRunner(ref.model, ref.tokenizer, name=ref.name,
                      linear_dtype=pick_linear_dtype(ref.device, ref.dtype, "bfloat16"))
    store = MemoryStore(4 << 30)
    engines = {"float32": BlendEngine(ref, store, EngineConfig(prefix_caching=False)),
               "bf16 weights": BlendEngine(low, store, EngineConfig(prefix_caching=False))}
    gen = GenerationConfig(max_tokens=args.max_tokens)
    rows: dict[str, list[tuple[float, bool, float, float]]] = {}
    try:
        for ex in load_examples(args.dataset, args.questions):
            passages = passages_of(ex, args.passages)
            for text in passages:
                engines["float32"].ensure_cached(text)
            for mode in (Mode.FULL_PREFILL, Mode.BLEND):
                plan = BlendPlan(passages, ex.question, mode=mode, recompute_ratio=0.15 if mode is Mode.BLEND else None)
                logits = {name: e.prefill(plan).logits for name, e in engines.items()}
                texts = {name: "".join(e.generate(plan, gen)) for name, e in engines.items()}
                times = {name: ttft_ms(e, plan) for name, e in engines.items()}
                row = (kl(logits["float32"], logits["bf16 weights"]), texts["float32"] == texts["bf16 weights"],
                       times["float32"], times["bf16 weights"])
                rows.setdefault(mode.value, []).append(row)
                print(f"{ex.id[:20]:20} {mode.value:12} KL {row[0]:.5f}  same answer {row[1]!s:5}  "
                      f"TTFT {row[2]:6.0f} vs {row[3]:6.0f} ms", flush=True)
    finally:
        for e in engines.values():
            e.close()
    for mode, vals in rows.items():
        print(f"{mode:12} n={len(vals)}  KL mean {statistics.mean(v[0] for v in vals):.5f} max "
              f"{max(v[0] for v in vals):.5f}  same greedy answer {sum(v[1] for v in vals)}/{len(vals)}  TTFT p50 "
              f"{statistics.median(v[2] for v in vals):.0f} (float32) vs {statistics.median(v[3] for v in vals):.0f} ms")


if __name__ == "__main__":
    main()
