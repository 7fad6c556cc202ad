"""In-memory tier: a byte-budgeted LRU. The hot tier, and the test double for the others."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from blend_engine.kv_store.base import ChunkKV, KVStore, StoreStats

STORAGE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class MemoryStore(KVStore):
    def __init__(self, budget_bytes: int = 2 << 30, kv_format: str = "fp16", name: str = "memory") -> None:
        if kv_format not in STORAGE_DTYPES:
            raise ValueError(f"memory store supports {sorted(STORAGE_DTYPES)}, not {kv_format!r}")
        self.name = name
        self._dtype = STORAGE_DTYPES[kv_format]
        self._budget = budget_bytes
        self._items: OrderedDict[str, ChunkKV] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = StoreStats(name=name, bytes_budget=budget_bytes)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def put(self, key: str, kv: ChunkKV) -> bool:
        stored = ChunkKV(kv.k.detach().to("cpu", self._dtype).contiguous(), kv.v.detach().to("cpu", self._dtype).contiguous())
        size = stored.nbytes()
        with self._lock:
            if size > self._budget:
                self._stats.skipped_puts += 1
                return False
            old = self._items.pop(key, None)
            if old is not None:
                self._stats.bytes_used -= old.nbytes()
            while self._items and self._stats.bytes_used + size > self._budget:
                _, evicted = self._items.popitem(last=False)
                self._stats.bytes_used -= evicted.nbytes()
                self._stats.evictions += 1
            self._items[key] = stored
            self._stats.bytes_used += size
            self._stats.puts += 1
            self._stats.entries = len(self._items)
            return True

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            kv = self._items.get(key)
            if kv is None:
                self._stats.misses += 1
                return None
            self._items.move_to_end(key)
            self._stats.hits += 1
            return kv

    def get_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        with self._lock:
            kv = self._items.get(key)
            if kv is None or layer >= kv.n_layers:
                self._stats.misses += 1
                return None
            if layer == 0:
                self._items.move_to_end(key)
                self._stats.hits += 1
            return kv.layer(layer)

    def delete(self, key: str) -> bool:
        with self._lock:
            kv = self._items.pop(key, None)
            if kv is None:
                return False
            self._stats.bytes_used -= kv.nbytes()
            self._stats.entries = len(self._items)
            return True

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**{**self._stats.__dict__, "extra": dict(self._stats.extra)})
