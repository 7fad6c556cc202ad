"""In-memory tier: a byte-budgeted LRU of chunks. The hot tier, and the test double.

Each chunk is one uint8 tensor of its layer blobs (layer-major), page-locked where CUDA exists so
a layer goes to the device in one DMA straight from it (`transfer`), plain memory on the CPU.
Blobs are views of it and float formats decode to views of those (no copy): callers must not
modify them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend_engine.kv_store.base import StoreStats
from blend_engine.kv_store.blob import Blob, BlobStore
from blend_engine.kv_store.codec import ChunkMeta
from blend_engine.kv_store.lru import ByteLRU
from blend_engine.kv_store.staging import pinnable

STORAGE_FORMATS = ("fp32", "fp16", "bf16", "int8")


@dataclass
class _Entry:
    meta: ChunkMeta
    data: torch.Tensor  # [L * layer_nbytes] uint8, pinned where CUDA exists
    blobs: list[memoryview]  # layer i's blob: a view of data


def _hold(meta: ChunkMeta, blobs: Sequence[Blob], pinned: bool) -> _Entry:
    """Copy a chunk's layer blobs into one tensor (page-locked when `pinned`)."""
    n = meta.layer_nbytes
    data = torch.empty(meta.nbytes, dtype=torch.uint8, pin_memory=pinned)  # [L * n]
    view = memoryview(data.numpy())
    for i, b in enumerate(blobs):
        view[i * n:(i + 1) * n] = b
    return _Entry(meta, data, [view[i * n:(i + 1) * n] for i in range(meta.n_layers)])


class MemoryStore(BlobStore):
    holds_blobs = True
    def __init__(self, budget_bytes: int = 2 << 30, kv_format: str = "fp16", name: str = "memory",
                 fingerprint: str = "", pinned: bool | None = None) -> None:
        if kv_format not in STORAGE_FORMATS:
            raise ValueError(f"memory store supports {list(STORAGE_FORMATS)}, not {kv_format!r}")
        super().__init__(name, kv_format, fingerprint)
        self.pinned = pinnable() if pinned is None else pinned  # page-locked only where CUDA exists
        self._lock = threading.Lock()
        self._stats = StoreStats(name=name, kind="memory", bytes_budget=budget_bytes)
        self._items: ByteLRU[_Entry] = ByteLRU(budget_bytes, self._stats)

    def can_hold(self, nbytes: int) -> bool:
        return self._items.fits(nbytes)

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
        entry = _hold(meta, blobs, self.pinned)  # the copy outside the lock
        with self._lock:
            self._items.pop(key)
            self._items.evict_for(meta.nbytes)
            self._items.add(key, meta.nbytes, entry)
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
