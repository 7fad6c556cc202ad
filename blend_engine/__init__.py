"""Blendserve's engine: per-passage KV caches, re-positioned by RoPE and repaired by CacheBlend."""

from blend_engine.engine import BlendEngine, EngineConfig, Generation, KVCache, PrefillState
from blend_engine.types import BlendPlan, BlendReport, BlendResult, GenerationConfig, Mode, SelectionPolicy

__all__ = [
    "BlendEngine", "BlendPlan", "BlendReport", "BlendResult", "EngineConfig", "Generation",
    "GenerationConfig", "KVCache", "Mode", "PrefillState", "SelectionPolicy",
]
