"""benchmarks.kernels.fused_step on the tiny random Llama: its fused and apart steps compute the same
decode logits (the benchmark times two ways of one computation)."""

from __future__ import annotations

import torch

from benchmarks.kernels.fused_step import Step
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.types import BlendPlan
from tests.helpers import PASSAGES, QUESTION


def test_the_fused_and_apart_steps_give_the_same_decode_logits(tiny_runner):
    eng = BlendEngine(tiny_runner, MemoryStore(1 << 26), EngineConfig())
    plan = BlendPlan(PASSAGES[:3], QUESTION, recompute_ratio=0.15)
    try:
        for seg in eng.layout(plan).segments[:-1]:
            eng.cache_ids(seg.token_ids)
        with torch.inference_mode():
            step = Step(eng, plan, batch=3, n_tokens=40)
            apart, fused = step.apart(), step.fused()  # [3, V] each
    finally:
        eng.close()
    assert apart.shape == (3, tiny_runner.shape.vocab)
    torch.testing.assert_close(fused, apart, atol=1e-4, rtol=1e-4)
