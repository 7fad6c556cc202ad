"""Build the configured store stack. Extended by the tiered store work (disk, Redis)."""

from __future__ import annotations

from pathlib import Path

from blend_engine.kv_store.base import KVStore
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.kv_store.memory import MemoryStore


def build_store(
    *,
    kv_format: str = "fp16",
    memory_bytes: int = 1 << 30,
    disk_dir: Path | None = None,
    disk_bytes: int = 20 << 30,
    redis_url: str | None = None,
    redis_timeout_s: float = 0.5,
) -> KVStore:
    """Memory tier on top of local disk (when disk_dir) on top of Redis (when redis_url)."""
    return MemoryStore(memory_bytes, kv_format=kv_format)


def build_loader(store: KVStore, prefetch_depth: int = 2) -> LayerLoader:
    return LayerLoader(store)
