"""A request's life in the engine loop: submitted, queued, admitted, prefilled, decoding, ended
(or dropped), and preempted and replayed on the way.

    submit -> Group (one per request: admission counts it) + Request (one per sequence, n of them)
           -> RequestTable.add: queued for the scheduler
           -> started: admitted to the batch (admission learns its queue time)
           -> preempt: its blocks taken back; its tokens so far are fed again (replay) once
                       it is prefilled anew, so it ends as it would have
           -> finish (answered) / drop (failed, cancelled, too late): ended; the last sequence of
              a request tells admission how the request went (`scheduler.admission`)

The table holds each sequence's host state and tensors (`Request`); the scheduler holds its blocks
(`scheduler.batch`), never a tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from blend_engine.cancel import Cancelled, DeadlineExceeded, StopCheck
from blend_engine.executor.layers import KVCache
from blend_engine.executor.prefill import PrefillRun, PrefillState
from blend_engine.generation import Generation
from blend_engine.layout import PromptLayout
from blend_engine.sampling import Sampler, StreamDecoder
from blend_engine.scheduler.admission import AdmissionControl
from blend_engine.scheduler.batch import BatchScheduler, SeqSpec
from blend_engine.scheduler.plans import ModePlan
from blend_engine.types import SelectionPolicy, TokenLogprob

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Prepared:
    """A request planned on its caller's thread: what the loop needs to start its prefill."""

    layout: PromptLayout
    keys: tuple[str | None, ...]
    mp: ModePlan
    policy: SelectionPolicy
    lookups: tuple[tuple[str, ...], ...] = ()  # block hash chains it may take a cached prefix from
    own: tuple[str, ...] = ()  # the chain its blocks are registered under
    min_hit: int = 1  # the shortest cached prefix worth taking

    def seq(self, rid: int) -> SeqSpec:
        return SeqSpec(rid, self.layout.n_tokens, self.lookups, self.own, self.min_hit)


@dataclass
class Group:
    """One submitted request's n sequences: admission takes, starts and ends it once."""

    should_stop: StopCheck  # the caller's abort (besides each sequence's `Generation.cancel`)
    timeout_s: float | None
    clock: Callable[[], float]  # the loop's (`EngineLoop.clock`)
    t0: float  # submitted, by `clock`
    live: int  # sequences not ended yet
    started: bool = False  # one of them was admitted to the batch
    queue_s: float = 0.0  # submitted until admitted
    cost_s: float = 0.0  # its share of the loop's step time while in the batch (admission learns it)
    completed: bool = True  # none failed or was cancelled
    places: int = field(init=False)  # its sequences (`live` at submit): the batch places admission counts it for

    def __post_init__(self) -> None:
        self.places = self.live

    @property
    def time_left_s(self) -> float | None:
        return None if self.timeout_s is None else self.timeout_s - self.elapsed_s

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.t0

    @property
    def expired(self) -> bool:
        left = self.time_left_s
        return left is not None and left <= 0


@dataclass
class Request:
    """The loop's state of one sequence (tensors included); dropped when it ends."""

    rid: int
    handle: Generation
    prep: Prepared
    group: Group
    t0: float  # submitted, by `time.perf_counter` (the timings' clock)
    cache: KVCache | None = None  # its run of the pool
    active: Prepared | None = None  # the prep its prefill runs (a cached prefix changes the plan)
    run: PrefillRun | None = None
    state: PrefillState | None = None
    sampler: Sampler | None = None
    decoder: StreamDecoder | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    next_token: int = 0
    replay: int | None = None  # after a preemption: the index of the generated token fed again
    waited: set[str] = field(default_factory=set)  # why it waited in the queue (counted once each)

    @property
    def aborted(self) -> bool:
        """Its caller stopped it (the handle's cancel, the request's abort)."""
        return self.handle.cancelled or self.group.should_stop()

    @property
    def stopped(self) -> bool:
        return self.aborted or self.group.expired

    def stop_error(self) -> Cancelled:
        if self.aborted:
            return Cancelled("request cancelled")
        return DeadlineExceeded(f"request exceeded its timeout of {self.group.timeout_s:g} s")

    def replayed(self) -> bool:
        """A preempted request's step that fed one of its earlier tokens again: the next one is
        known. False once the last earlier token is in: this step's logits give a new token."""
        if self.replay is None:
            return False
        self.replay += 1
        if self.replay < len(self.tokens):
            self.next_token = self.tokens[self.replay]
            return True
        self.replay = None
        return False

    def preempted(self) -> None:
        """Its blocks were taken back: its KV and prefill go; tokens, sampler and stream stay, so
        that once admitted again it is prefilled anew and its tokens so far are fed again."""
        if self.run is not None and self.state is None:
            self.run.close()
        self.cache = self.run = self.state = self.active = None
        self.replay = None
        logger.info("request %d preempted after %d tokens (KV pool full)", self.rid, len(self.tokens))


class RequestTable:
    """The sequences in the loop (queued or in the batch), by id; their endings, told to the
    scheduler (their blocks) and to admission (the request's outcome). The loop's thread only."""

    def __init__(self, scheduler: BatchScheduler, admission: AdmissionControl) -> None:
        self.scheduler, self.admission = scheduler, admission
        self._by_id: dict[int, Request] = {}

    def __contains__(self, rid: int) -> bool:
        return rid in self._by_id

    def __getitem__(self, rid: int) -> Request:
        return self._by_id[rid]

    def values(self) -> list[Request]:
        return list(self._by_id.values())

    def pick(self, rids: Iterable[int]) -> list[Request]:
        """The requests among `rids` still in the table, in that order."""
        return [self._by_id[rid] for rid in rids if rid in self._by_id]

    def add(self, req: Request) -> None:
        self._by_id[req.rid] = req

    def guard(self, req: Request, fn: Callable[[Request], T]) -> T | None:
        """Run one request's share of a step; its failure (or cancellation) ends it alone."""
        try:
            return fn(req)
        except BaseException as exc:  # noqa: BLE001 - handed to the request's caller
            self.drop(req, exc)
            return None

    # ------------------------------------------------------------------ admission (`scheduler.admission`)
    def drop_stopped(self) -> None:
        """Cancelled and timed-out requests leave; queued ones that could not finish in time too."""
        for req in [r for r in self._by_id.values() if r.stopped]:
            self.drop(req, req.stop_error())
        for req in [r for r in self._by_id.values() if self._too_late(r)]:
            self.drop(req, DeadlineExceeded("not started: it could not finish before its deadline"), "dropped_too_late")

    def _too_late(self, req: Request) -> bool:
        """Still queued, and its time left is shorter than it would take beside the running ones."""
        g = req.group
        return not g.started and self.admission.too_late(g.time_left_s, g.timeout_s)

    def count_wait(self, held: tuple[int, str] | None) -> None:
        """The head of the queue waited this step: counted once per request and reason."""
        if held is None or held[0] not in self._by_id:
            return
        req = self._by_id[held[0]]
        if held[1] not in req.waited:
            req.waited.add(held[1])
            self.admission.waited(held[1])

    def started(self, req: Request) -> None:
        g = req.group
        if not g.started:
            g.started, g.queue_s = True, g.elapsed_s
            self.admission.started(g.places)

    def batch_groups(self) -> dict[int, Group]:
        """The requests in the batch (started, not ended), each once whatever its n."""
        return {id(r.group): r.group for r in self._by_id.values() if r.group.started}

    @staticmethod
    def share(batch: dict[int, Group], seconds: float) -> None:
        """A step's time, divided among the requests it served: each one's cost."""
        for g in batch.values():
            g.cost_s += seconds / len(batch)

    def prefill_waits(self) -> bool:
        """Prefill work is queued or running (background work then takes a smaller share of the turns)."""
        return bool(self.scheduler.waiting) or any(r.state is None for r in self._by_id.values())

    # ------------------------------------------------------------------ endings
    def finish(self, req: Request) -> None:
        """Answered: its blocks go back (its prompt's stay cached: automatic prefix caching)."""
        self.scheduler.finish(req.rid)
        self._by_id.pop(req.rid, None)
        self._ended(req, completed=True)

    def drop(self, req: Request, exc: BaseException, why: str | None = None) -> None:
        """End a request that failed or was cancelled (`why`: admission dropped it); the rest of the
        batch is untouched."""
        self.scheduler.finish(req.rid)
        if self._by_id.pop(req.rid, None) is not None:  # not when it already ended
            self._ended(req, completed=False, dropped=why)
        if req.run is not None and req.state is None:
            req.run.close()
        if not isinstance(exc, Cancelled):
            logger.warning("request %d failed: %s", req.rid, exc)
        req.handle.fail(exc)

    def drop_all(self, exc: BaseException, pending: Iterable[Request]) -> None:
        """Shutting down: every request in the table, and `pending` ones that never reached it."""
        for req in list(self._by_id.values()):
            self.drop(req, exc)
        for req in pending:
            self.drop(req, exc)
            self._ended(req, completed=False)

    def _ended(self, req: Request, completed: bool, dropped: str | None = None) -> None:
        """One sequence ended; the last of its request tells admission how the request went."""
        g = req.group
        g.live -= 1
        g.completed = g.completed and completed
        if g.live:
            return
        if g.started:
            self.admission.finished(g.cost_s if g.completed else None, g.places)
        else:
            self.admission.left_queue(dropped)
