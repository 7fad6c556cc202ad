"""What the memory and the device tier share: chunks held in the tier's own buffers, in a byte-budgeted
LRU (`ByteLRU`) under one lock, with the hit/miss/byte counters of a layer served.

A subclass says how a chunk is held (`_hold`: its blobs copied into one buffer of the tier's kind)
and how a held layer is handed out (`get_blob`, from `_served`). `evict_before_hold`: evict before
the copy, so the memory is free before the new chunk takes it (the device tier); otherwise the copy
runs first, outside the lock, and only a chunk that fits replaces anything.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from blend_engine.kv_store.base import StoreStats
from blend_engine.kv_store.blob import Blob, BlobStore
from blend_engine.kv_store.codec import ChunkMeta
from blend_engine.kv_store.lru import ByteLRU


class HeldTier(BlobStore):
    holds_blobs = True
    evict_before_hold = False

    def __init__(self, name: str, kv_format: str, fingerprint: str, budget_bytes: int, kind: str) -> None:
        super().__init__(name, kv_format, fingerprint)
        self._lock = threading.Lock()
        self._stats = StoreStats(name=name, kind=kind, bytes_budget=budget_bytes)
        self._items: ByteLRU[Any] = ByteLRU(budget_bytes, self._stats)

    @abstractmethod
    def _hold(self, meta: ChunkMeta, blobs: Sequence[Blob]) -> Any:
        """The chunk's blobs copied into the tier's own buffer: the entry (with `.meta`) kept for it."""

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
            if self.evict_before_hold:
                self._items.pop(key)
                self._items.evict_for(meta.nbytes)
        entry = self._hold(meta, blobs)  # the copy outside the lock
        with self._lock:
            self._items.pop(key)
            self._items.evict_for(meta.nbytes)
            self._items.add(key, meta.nbytes, entry)
            self._stats.puts += 1
            return True

    def _served(self, key: str, layer: int) -> Any:
        """The entry holding `key` if it has `layer` (counted as served: a hit and recency at layer 0,
        its bytes read), else None (a miss at layer 0)."""
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
            return e

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
