"""The prefix cache of `prefix_cache` mode (vLLM/SGLang style), kept per engine in memory.

An entry is the *in-context* KV of one leading segment, keyed by the chain of the segments
before it, so it is reused only by a prompt that starts with exactly the same segments::

    | sys | chunk_1 | chunk_2 | ... | question |
      c0 = chain(sys)   c1 = chain(c0, chunk_1)   c2 = chain(c1, chunk_2)   (never cached)

Entries sit where they were computed (no RoPE move). The system prompt alone at position 0 is
exact in context too, so it is seeded from the chunk store. The byte budget is a setting
(`BLENDSERVE_PREFIX_CACHE_MB`); `stats()` reports its use.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from blend_engine.keys import chain_key
from blend_engine.kv_store import KVStore, MemoryStore
from blend_engine.kv_store.base import StoreStats
from blend_engine.layout import Segment

if TYPE_CHECKING:
    from blend_engine.executor.layers import KVCache


class PrefixCache:
    """In-context KV of leading segment runs, within `budget_bytes` (LRU)."""

    def __init__(self, budget_bytes: int, kv_format: str, chunks: KVStore) -> None:
        self.store = MemoryStore(budget_bytes, kv_format=kv_format, name="prefix")
        self._chunks = chunks  # the chunk store: the system prompt's alone-KV seeds the chain

    @staticmethod
    def chain(segs: Sequence[Segment], keys: Sequence[str | None]) -> Iterator[tuple[Segment, str, bool]]:
        """Leading cacheable segments with their in-context keys (and whether it is the first)."""
        parent = None
        for seg, key in zip(segs, keys):
            if key is None:
                return
            ck = chain_key(parent, key)
            yield seg, ck, parent is None
            parent = ck

    def match(self, segs: Sequence[Segment], keys: Sequence[str | None]) -> tuple[list[tuple[Segment, str]], int]:
        """(longest run of leading segments whose in-context KV is held, tokens it covers)."""
        matched: list[tuple[Segment, str]] = []
        for (seg, ck, first), key in zip(self.chain(segs, keys), keys):
            if first and not self.store.contains(ck):  # sys alone at 0 is exact in context
                kv = self._chunks.get(key)
                if kv is not None:
                    self.store.put(ck, kv)
            if not self.store.contains(ck):
                break
            matched.append((seg, ck))
        return matched, (matched[-1][0].end if matched else 0)

    def save(self, segs: Sequence[Segment], keys: Sequence[str | None], cache: KVCache) -> None:
        """Keep every leading segment's in-context KV from a finished prefill's cache."""
        for seg, ck, _ in self.chain(segs, keys):
            if not self.store.contains(ck):
                self.store.put(ck, cache.segment(seg.offset, seg.end))

    def stats(self) -> StoreStats:
        return self.store.stats()
