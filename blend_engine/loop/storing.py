"""Background work of the engine loop: the alone-KV of passages that missed the store, stored after
their request's answer went out (the answer never waits for work that only helps later requests).

    request A answers  ->  add(A's missed passages)      queue: | p3 | p7 | p9 |
    each loop turn     ->  step(): one passage stored     (while prefill work waits: one every
                                                           `busy_stride` turns, never starved)
    request B arrives  ->  store_now(B's missed keys)     a passage B needs that is still queued is
                           (before B is planned again)     stored once, first; one stored after B's plan
                                                           was made counts too: B is planned again

The store's own write is atomic (contains-then-put, `ChunkCache.store_missing`), so a crash or a
shutdown loses nothing already stored and leaves no half-written entry; what is still queued is
dropped (a later request that misses it queues it again).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from blend_engine.layout import PromptLayout

logger = logging.getLogger(__name__)
StoreFn = Callable[[PromptLayout, Sequence[int], "str | None"], int]  # ChunkCache.store_missing
RECENT = 4096  # keys remembered as stored lately


@dataclass(frozen=True)
class StoreJob:
    """One passage to store: segment `index` of `layout`, chunk `key`, the request's tenant salt."""

    layout: PromptLayout
    index: int
    key: str
    salt: str | None


class PassageStoring:
    """The queue of passages to store, one at a time, oldest first, each key once."""

    def __init__(self, store: StoreFn, busy_stride: int = 4) -> None:
        if busy_stride < 1:
            raise ValueError("busy_stride must be >= 1")
        self._store, self.busy_stride = store, busy_stride
        self._queue: OrderedDict[str, StoreJob] = OrderedDict()
        self._recent: OrderedDict[str, None] = OrderedDict()  # keys stored lately (a plan made before may miss them)
        self._turns = 0
        self.paused = False  # a seam: background turns store nothing (`store_now` still does)
        self.stored = self.failed = self.deferred = 0  # counters for stats
        self.seconds = 0.0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def has_work(self) -> bool:
        """Something to store on a background turn (the loop waits when nothing else has work)."""
        return bool(self._queue) and not self.paused

    def add(self, layout: PromptLayout, keys: Sequence[str | None], missing: Iterable[int], salt: str | None) -> int:
        """Queue segment indices `missing` (their `keys`) not queued already; how many were added."""
        added = 0
        for i in missing:
            key = keys[i]
            if key is not None and key not in self._queue:
                self._queue[key] = StoreJob(layout, i, key, salt)
                added += 1
        return added

    def queued(self, keys: Iterable[str | None]) -> list[str]:
        """The keys among `keys` still waiting to be stored."""
        return [k for k in keys if k is not None and k in self._queue]

    def store_now(self, keys: Iterable[str | None]) -> bool:
        """Store the queued ones among `keys` at once (a request planned without them needs them);
        whether any of `keys` is stored now that was queued or stored lately: its plan is stale."""
        keys = [k for k in keys if k is not None]
        for k in self.queued(keys):
            self._run(self._queue.pop(k))
        return any(k in self._recent for k in keys)

    def step(self, busy: bool) -> bool:
        """One loop turn: store the oldest queued passage, or (while `busy`: prefill work waits) only
        every `busy_stride`-th turn. Whether one was stored."""
        if not self._queue or self.paused:
            return False
        self._turns += 1
        if busy and self._turns % self.busy_stride:
            self.deferred += 1
            return False
        _, job = self._queue.popitem(last=False)
        return self._run(job)

    def _run(self, job: StoreJob) -> bool:
        """Store one passage; a failure is logged and counted (its answer is out already)."""
        t0 = time.perf_counter()
        try:
            self._store(job.layout, [job.index], job.salt)
        except Exception as exc:  # noqa: BLE001 - background work: never the answer's error
            self.failed += 1
            logger.warning("storing a missed passage's KV (%s) failed: %s", job.key[:12], exc)
            return False
        finally:
            self.seconds += time.perf_counter() - t0
        self.stored += 1
        self._recent[job.key] = None
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        return True

    def clear(self) -> int:
        """Drop what is queued (shutdown); how many were dropped."""
        n = len(self._queue)
        self._queue.clear()
        return n

    def stats(self) -> dict:
        return {"store_queued": len(self._queue), "store_done": self.stored, "store_failed": self.failed,
                "store_deferred_turns": self.deferred, "store_seconds": self.seconds}
