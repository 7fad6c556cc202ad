"""A byte-budget LRU: the bookkeeping the memory, device and disk tiers share.

It keeps entries in use order (oldest first) with their sizes, and the tier's `StoreStats`
counters that follow from them: bytes_used, entries and evictions. It only forgets entries; the
tier removes what an evicted key held (the disk tier its file and index row). Not thread-safe:
the tier calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from blend_engine.kv_store.base import StoreStats

V = TypeVar("V")


class ByteLRU(Generic[V]):
    def __init__(self, budget_bytes: int, stats: StoreStats) -> None:
        self.budget = budget_bytes
        self._stats = stats
        self._items: OrderedDict[str, tuple[int, V]] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> V | None:
        item = self._items.get(key)
        return None if item is None else item[1]

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._items)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.budget

    def touch(self, key: str) -> None:
        self._items.move_to_end(key)

    def add(self, key: str, nbytes: int, value: V) -> None:
        """Record an entry as most recently used (replacing one under the same key)."""
        self.pop(key)
        self._items[key] = (nbytes, value)
        self._stats.bytes_used += nbytes
        self._stats.entries = len(self._items)

    def pop(self, key: str) -> V | None:
        item = self._items.pop(key, None)
        if item is None:
            return None
        self._stats.bytes_used -= item[0]
        self._stats.entries = len(self._items)
        return item[1]

    def evict_for(self, incoming: int) -> list[str]:
        """Forget the oldest entries until `incoming` more bytes fit the budget; the keys forgotten."""
        evicted = []
        while self._items and self._stats.bytes_used + incoming > self.budget:
            evicted.append(self._evict_oldest())
        return evicted

    def evict_bytes(self, nbytes: int) -> list[str]:
        """Forget the oldest entries until at least `nbytes` are freed (or none is left), whatever the budget."""
        evicted, freed = [], 0
        while self._items and freed < nbytes:
            freed += next(iter(self._items.values()))[0]
            evicted.append(self._evict_oldest())
        return evicted

    def _evict_oldest(self) -> str:
        key = next(iter(self._items))
        self.pop(key)
        self._stats.evictions += 1
        return key
