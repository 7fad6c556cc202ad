"""Blendserve's engine: per-passage KV caches, re-positioned by RoPE and repaired by CacheBlend.

Nothing heavy loads on `import blend_engine`: `blend_engine.types` is torch-free, and the names
below are imported from their modules on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    **dict.fromkeys(("BlendEngine", "EngineConfig", "PrefillState"), "blend_engine.engine"),
    "Generation": "blend_engine.generation",
    "KVCache": "blend_engine.executor.layers",
    **dict.fromkeys(("BlendPlan", "BlendReport", "BlendResult", "GenerationConfig", "Mode", "SelectionPolicy"),
                    "blend_engine.types"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'blend_engine' has no attribute {name!r}")
