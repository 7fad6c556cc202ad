"""Background work of the engine loop: the alone-KV of passages that missed the store, stored after
their request's answer went out (the answer never waits for work that only helps later requests).

    request A answers  ->  add(A's missed passages)      queue: | p3 | p7 | p9 |
    a background unit  ->  step(): one layer of the       (`background.Background` decides how many
                           oldest passage's precompute     units a turn: a bounded share of the loop)
    request B arrives  ->  store_now(B's missed keys)     a passage B needs that is queued, or half
                           (before B is planned again)     done, is finished first, computed once; one
                                                           stored after B's plan was made counts too:
                                                           B is planned again

A passage is one stepped job (`ChunkCache.store_steps`): its layers run a unit at a time, then the
whole entry is written at once (the store's contains-then-put), so a crash or a shutdown loses nothing
already stored and leaves no half-written entry; what is queued or half done is dropped (a later
request that misses it queues it again).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from blend_engine.layout import PromptLayout
from blend_engine.steps import Steps, drain

logger = logging.getLogger(__name__)
StoreSteps = Callable[[Sequence[int], "str | None"], Steps[bool]]  # ChunkCache.store_steps
RECENT = 4096  # keys remembered as stored lately


@dataclass(frozen=True)
class StoreJob:
    """One passage to store: segment `index` of `layout`, chunk `key`, the request's tenant salt."""

    layout: PromptLayout
    index: int
    key: str
    salt: str | None


class PassageStoring:
    """The queue of passages to store, oldest first, each key once; the first one in progress."""

    def __init__(self, store_steps: StoreSteps, clock: Callable[[], float] = time.perf_counter) -> None:
        self._store_steps, self._clock = store_steps, clock
        self._queue: OrderedDict[str, StoreJob] = OrderedDict()
        self._current: tuple[StoreJob, Steps[bool]] | None = None  # the passage whose layers are running
        self._recent: OrderedDict[str, None] = OrderedDict()  # keys stored lately (a plan made before may miss them)
        self.paused = False  # a seam: background units store nothing (`store_now` still does)
        self.stored = self.failed = self.units = 0  # counters for stats
        self.seconds = 0.0

    def __len__(self) -> int:
        """Passages queued or in progress."""
        return len(self._queue) + (self._current is not None)

    @property
    def has_work(self) -> bool:
        """Something to store on a background unit (the loop waits when nothing else has work)."""
        return bool(len(self)) and not self.paused

    def add(self, layout: PromptLayout, keys: Sequence[str | None], missing: Iterable[int], salt: str | None) -> int:
        """Queue segment indices `missing` (their `keys`) not queued already; how many were added."""
        added = 0
        for i in missing:
            key = keys[i]
            if key is not None and key not in self._queue and key != self._current_key:
                self._queue[key] = StoreJob(layout, i, key, salt)
                added += 1
        return added

    @property
    def _current_key(self) -> str | None:
        return None if self._current is None else self._current[0].key

    def queued(self, keys: Iterable[str | None]) -> list[str]:
        """The keys among `keys` still waiting to be stored (queued or in progress)."""
        return [k for k in keys if k is not None and (k in self._queue or k == self._current_key)]

    def store_now(self, keys: Iterable[str | None]) -> bool:
        """Store the queued ones among `keys` at once (a request planned without them needs them; one
        in progress goes on from its next layer); whether any of `keys` is stored now that was queued
        or stored lately: its plan is stale."""
        keys = [k for k in keys if k is not None]
        for k in self.queued(keys):
            if k == self._current_key:
                job, steps = self._current  # type: ignore[misc]
                self._current = None
            else:
                job = self._queue.pop(k)
                steps = self._start(job)
            self._finish(job, lambda steps=steps: drain(steps))
        return any(k in self._recent for k in keys)

    def step(self) -> bool:
        """One unit: a layer of the oldest passage's precompute (its write after the last). Whether a
        unit ran."""
        if self.paused or not len(self):
            return False
        if self._current is None:
            job = self._queue.popitem(last=False)[1]
            self._current = (job, self._start(job))
        job, steps = self._current
        self.units += 1

        def advance() -> bool | None:
            try:
                next(steps)
                return None  # more layers to go
            except StopIteration as done:
                return done.value

        self._finish(job, advance)
        return True

    def _start(self, job: StoreJob) -> Steps[bool]:
        return self._store_steps(job.layout.segments[job.index].token_ids, job.salt)

    def _finish(self, job: StoreJob, run: Callable[[], bool | None]) -> None:
        """Run `run` (a unit, or the rest of `job`), timed; a result other than None ends the job.
        A failure is logged and counted (the answer is out already) and ends it."""
        t0 = self._clock()
        failed = False
        try:
            done = run()
        except Exception as exc:  # noqa: BLE001 - background work: never the answer's error
            self.failed += 1
            logger.warning("storing a missed passage's KV (%s) failed: %s", job.key[:12], exc)
            done, failed = False, True
        finally:
            self.seconds += self._clock() - t0
        if done is None:
            return
        if self._current is not None and self._current[0] is job:
            self._current = None
        if failed:
            return
        self.stored += bool(done)
        self._recent[job.key] = None  # stored now, or found stored (either way a plan that missed it is stale)
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)

    def clear(self) -> int:
        """Drop what is queued or in progress (shutdown; nothing half-written); how many were dropped."""
        n = len(self)
        if self._current is not None:
            self._current[1].close()
            self._current = None
        self._queue.clear()
        return n

    def stats(self) -> dict:
        return {"store_queued": len(self), "store_done": self.stored, "store_failed": self.failed,
                "store_units": self.units, "store_seconds": self.seconds}
