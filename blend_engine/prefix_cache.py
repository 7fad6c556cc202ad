"""The prefix cache of `prefix_cache` mode (vLLM/SGLang style), kept per engine in memory.

An entry is the *in-context* KV of one leading segment, keyed by the chain of the segments
before it, so it is reused only by a prompt that starts with exactly the same segments::

    | sys | chunk_1 | chunk_2 | ... | question |
      c0 = chain(sys)   c1 = chain(c0, chunk_1)   c2 = chain(c1, chunk_2)   (never cached)

Entries sit where they were computed (no RoPE move). The system prompt alone at position 0 is
exact in context too, so it is seeded from the chunk store. The byte budget is a setting
(`BLENDSERVE_ENGINE_PREFIX_CACHE_MB`); `stats()` reports its use.

Saving is off the critical path: the engine calls `save` after the request's first token, which
issues one non-blocking copy per new segment to host memory (`executor.offload`) and hands it to
this cache's saver thread; that thread waits for the copy and stores the entry. Until then the
entry is pending: `match` waits for a pending entry it needs (on the caller's thread, never the
engine loop's), so the next request reuses it as if it had been stored at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterator, Sequence

from blend_engine.executor.layers import KVCache
from blend_engine.executor.offload import HostCopy, copy_to_host
from blend_engine.keys import chain_key
from blend_engine.kv_store import KVStore, MemoryStore
from blend_engine.kv_store.base import StoreStats
from blend_engine.kv_store.codec import layer_nbytes
from blend_engine.layout import Segment
from blend_engine.model.cpu_threads import one_core

logger = logging.getLogger(__name__)


class PrefixCache:
    """In-context KV of leading segment runs, within `budget_bytes` (LRU)."""

    def __init__(self, budget_bytes: int, kv_format: str, chunks: KVStore) -> None:
        self.store = MemoryStore(budget_bytes, kv_format=kv_format, name="prefix")
        self._chunks = chunks  # the chunk store: the system prompt's alone-KV seeds the chain
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future] = {}  # in-context key -> its save in flight
        self._saver: concurrent.futures.ThreadPoolExecutor | None = None  # started by the first save

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
            self._settle(ck)
            if first and not self.store.contains(ck):  # sys alone at 0 is exact in context
                kv = self._chunks.get(key)
                if kv is not None:
                    self.store.put(ck, kv)
            if not self.store.contains(ck):
                break
            matched.append((seg, ck))
        return matched, (matched[-1][0].end if matched else 0)

    def save(self, segs: Sequence[Segment], keys: Sequence[str | None], cache: KVCache) -> None:
        """Keep every leading segment's in-context KV from a finished prefill's cache: one
        non-blocking copy per segment not yet held, stored by the saver thread when it completes.
        Call it after the first token; the cache's prompt positions must not change afterwards
        (decoding writes only after them)."""
        for seg, ck, _ in self.chain(segs, keys):
            with self._lock:
                if ck in self._pending or self.store.contains(ck) or not self._fits(cache, seg):
                    continue
                self._pending[ck] = self._start().submit(self._store, ck, copy_to_host(cache, seg.offset, seg.end))

    def drain(self) -> None:
        """Wait until every save in flight is stored (a benchmark times each request alone: on the
        CPU the saver's encoding and copy would otherwise run inside the next request's time)."""
        with self._lock:
            pending = list(self._pending.values())
        for save in pending:
            save.result()

    def close(self) -> None:
        """Finish the saves in flight and stop the saver thread."""
        with self._lock:
            saver, self._saver = self._saver, None
        if saver is not None:
            saver.shutdown(wait=True)

    def stats(self) -> StoreStats:
        return self.store.stats()

    def _fits(self, cache: KVCache, seg: Segment) -> bool:
        """Whether the budget could hold this entry at all (else it is not worth copying)."""
        H, _, D = cache.k[0].shape
        return self.store.can_hold(len(cache.k) * layer_nbytes(self.store.kv_format, H, seg.end - seg.offset, D))

    def _start(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._saver is None:
            self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefix-save",
                                                               initializer=one_core)  # `cpu_threads`
        return self._saver

    def _store(self, ck: str, copy: HostCopy) -> None:
        """On the saver thread: wait for the copy, store the entry (a failure is logged: the entry is missed)."""
        try:
            self.store.put(ck, copy.kv())
        except Exception:  # noqa: BLE001 - a lost save must not fail the request that answered
            logger.exception("saving prefix cache entry %s failed", ck)
        finally:
            with self._lock:
                self._pending.pop(ck, None)

    def _settle(self, ck: str) -> None:
        """Wait for this entry's save if one is in flight."""
        with self._lock:
            pending = self._pending.get(ck)
        if pending is not None:
            pending.result()
