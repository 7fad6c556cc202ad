"""In-memory tier: a byte-budgeted LRU of per-layer blobs. The hot tier, and the test double.

Float formats decode to views of the stored bytes (no copy): callers must not modify them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from blend_engine.kv_store.base import StoreStats
from blend_engine.kv_store.blob import Blob, BlobStore
from blend_engine.kv_store.codec import ChunkMeta
from blend_engine.kv_store.lru import ByteLRU

STORAGE_FORMATS = ("fp32", "fp16", "bf16", "int8")


@dataclass
class _Entry:
    meta: ChunkMeta
    blobs: list[Blob]


class MemoryStore(BlobStore):
    def __init__(self, budget_bytes: int = 2 << 30, kv_format: str = "fp16", name: str = "memory",
                 fingerprint: str = "") -> None:
        if kv_format not in STORAGE_FORMATS:
            raise ValueError(f"memory store supports {list(STORAGE_FORMATS)}, not {kv_format!r}")
        super().__init__(name, kv_format, fingerprint)
        self._lock = threading.Lock()
        self._stats = StoreStats(name=name, bytes_budget=budget_bytes)
        self._items: ByteLRU[_Entry] = ByteLRU(budget_bytes, self._stats)

    def meta(self, key: str) -> ChunkMeta | None:
        with self._lock:
            e = self._items.get(key)
            return None if e is None else e.meta

    def put_blobs(self, key: str, meta: ChunkMeta, blobs: Sequence[Blob]) -> bool:
        self.check_meta(meta)
        with self._lock:
            if not self._items.fits(meta.nbytes):
                self._stats.skipped_puts += 1
                return False
            self._items.pop(key)
            self._items.evict_for(meta.nbytes)
            self._items.add(key, meta.nbytes, _Entry(meta, list(blobs)))
            self._stats.puts += 1
            return True

    def get_blob(self, key: str, layer: int) -> tuple[ChunkMeta, Blob] | None:
        with self._lock:
            e = self._items.get(key)
            if e is None or layer >= e.meta.n_layers:
                if layer == 0:
                    self._stats.misses += 1
                return None
            if layer == 0:
                self._items.touch(key)
                self._stats.hits += 1
            self._stats.bytes_read += e.meta.layer_nbytes
            return e.meta, e.blobs[layer]

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return self._items.keys()

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._items.pop(key) is not None

    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats.snapshot()
