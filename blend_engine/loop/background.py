"""The engine loop's background work: whatever runs the model for something other than a request in the
batch, on the loop's thread, between its steps (the one thread that computes; `cpu_threads`).

    loop turn:  | step (the batch) | one task | background units .................. |
                                     ingestion    a layer of a missed passage's store,
                                     precompute   a layer of a fidelity-gate prefill (in turns)

- **tasks** (`run_task`): a callable run whole between two steps (ingestion's KV precompute, its
  embedding batches); one per turn.
- **storing** (`storing.PassageStoring`): missed passages' alone-KV, stored after their answers, a
  layer a unit.
- **stepped jobs** (`run_stepped`, `steps.Steps`): a generator advanced a unit at a time (the start-up
  fidelity gate: ~20 prefills, a layer a unit).

Units yield to requests, so a request waits for one unit, never for a job. While any request is in
the batch, units take at most `SHARE` of the loop's time (`BUSY_SHARE` while a request's prefill
waits): each step earns them credit in proportion to its time, each unit spends its own (one may
overrun; a debt is paid by later steps), so a decoding stream slows by about `SHARE`, not by a whole
passage between two tokens, and the gate still finishes under steady load. With no request they run
for a slice of at least `IDLE_SLICE_S` (as long as the turn's task, so they share the loop evenly with
ingestion). Storing and stepped jobs alternate units.

Units also make way for the host work of queries (`hold` / `release`: retrieval, rerank, tokenizing on
the service's query threads, which run on what CPU the loop leaves): while any is held, no unit runs,
for at most `MAX_HOLD_S` at a time, after which one turn's units run and the hold counts afresh (so
storing advances under a steady stream of queries). Measured on 2 cores: the same prompt again right
after a cold one waited 545 ms for the cold one's storing under SCHED_IDLE query threads, ~100 ms with
nothing to store. Callers on other threads block on a future; on
the loop's own thread, or before the loop started, the work runs directly on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from blend_engine.cancel import Cancelled, StopCheck, stop_if
from blend_engine.loop.storing import PassageStoring, StoreSteps
from blend_engine.steps import Steps, drain

logger = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_SLICE_S = 0.05  # background units' least time a turn while no request is in the batch
SHARE = 0.25  # of the loop's time that background units may take while requests are in the batch
BUSY_SHARE = 0.05  # ... while a request's prefill waits
MAX_CREDIT_S = 0.25  # unspent credit, at most (none is earned while there is nothing to run)
MAX_HOLD_S = 0.5  # units wait for held host work at most this long at a time


@dataclass
class _Task:
    fn: Callable[[], Any]
    should_stop: StopCheck | None
    fut: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Stepped:
    make: Callable[[], Steps]
    fut: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    steps: Steps | None = None  # made on the loop's thread at its first unit


class Background:
    """Tasks, storing and stepped jobs of one engine loop. `cond` is the loop's condition (notified
    when work arrives); `loop_thread()` its thread, None before it started; `clock` times units (a
    seam for tests)."""

    def __init__(self, cond: threading.Condition, loop_thread: Callable[[], threading.Thread | None],
                 store_steps: StoreSteps, clock: Callable[[], float] = time.perf_counter) -> None:
        self._cond, self._loop_thread, self._clock = cond, loop_thread, clock
        self.storing = PassageStoring(store_steps, clock)
        self._tasks: deque[_Task] = deque()
        self._stepped: deque[_Stepped] = deque()
        self._closed = False
        self._credit = 0.0  # seconds of units earned by steps and not yet spent (`turn`)
        self._storing_next = True  # storing and stepped jobs alternate units
        self._holds = 0  # host work in flight that units make way for (`hold`)
        self._held_since = 0.0  # when units began to wait for it
        self.stepped_units = self.deferred_turns = self.held_turns = 0  # counters for stats

    # ------------------------------------------------------------------ callers' side (any thread)
    def run_task(self, fn: Callable[[], T], should_stop: StopCheck | None = None) -> T:
        """`fn()` on the loop's thread between steps. Raises `Cancelled` instead of starting it once
        `should_stop()` is true (`fn` checks it itself once started)."""
        if self._here():
            stop_if(should_stop, "before the task started")
            return fn()
        return self._queue(self._tasks, _Task(fn, should_stop)).result()

    def run_stepped(self, make: Callable[[], Steps[T]]) -> T:
        """Advance `make()`'s generator one unit per loop turn until it returns; its return value."""
        if self._here():
            return drain(make())
        return self._queue(self._stepped, _Stepped(make)).result()

    def hold(self) -> None:
        """Host work of a query starts: units wait until it ends (`release`), up to `MAX_HOLD_S`."""
        with self._cond:
            self._holds += 1
            if self._holds == 1:
                self._held_since = self._clock()

    def release(self) -> None:
        """The host work `hold` announced ended; the last one wakes the loop for its units."""
        with self._cond:
            if self._holds <= 0:
                raise RuntimeError("release() without hold()")
            self._holds -= 1
            if self._holds == 0:
                self._cond.notify()

    def _here(self) -> bool:
        thread = self._loop_thread()
        return thread is None or threading.current_thread() is thread

    def _queue(self, queue: deque, item: _Task | _Stepped) -> concurrent.futures.Future:
        with self._cond:
            if self._closed:
                raise Cancelled("the engine is shutting down")
            queue.append(item)
            self._cond.notify()
        return item.fut

    # ------------------------------------------------------------------ the loop's side
    @property
    def has_work(self) -> bool:
        """Anything for a turn now (the loop sleeps when neither this nor the batch has work). Under `cond`."""
        return bool(self._tasks) or (self._has_units and not self._held())

    def wait_s(self) -> float | None:
        """How long the loop may sleep with nothing to do: until held units may run, else until woken
        (None). Under `cond`."""
        if self._has_units and self._held():
            return max(self._held_since + MAX_HOLD_S - self._clock(), 1e-3)
        return None

    @property
    def _has_units(self) -> bool:
        return self.storing.has_work or bool(self._stepped)

    def _held(self) -> bool:
        """Units make way for host work: some is held, and for less than `MAX_HOLD_S` so far."""
        return self._holds > 0 and self._clock() - self._held_since < MAX_HOLD_S

    def turn(self, step_s: float, busy: bool = False, idle: bool = False) -> None:
        """One loop turn's background work, after a step of `step_s` seconds: a task, then units.
        `idle`: no request is queued or in the batch: units for a slice (at least `IDLE_SLICE_S`, as
        long as the task took). Else units while credit lasts: the step earned `SHARE` of the loop's
        time (`BUSY_SHARE` while `busy`: a request's prefill waits)."""
        t0 = self._clock()
        with self._cond:
            task = self._tasks.popleft() if self._tasks else None
        if task is not None:
            _run_task(task)
        with self._cond:
            holding = self._holds > 0
            forced = holding and not self._held()  # waited MAX_HOLD_S: this turn's units run
            if forced:
                self._held_since = self._clock()  # ... and the wait counts afresh
        if holding and not forced and self._has_units:
            self.held_turns += 1
            return  # no credit earned either: no burst of units when the host work ends

        def go() -> bool:  # host work that starts meanwhile waits for one unit at most
            return forced or self._holds == 0

        if idle:
            self._credit = 0.0
            deadline = self._clock() + max(self._clock() - t0, IDLE_SLICE_S)
            while go() and self._unit() and self._clock() < deadline:
                pass
            return
        if not self._has_units:
            self._credit = min(self._credit, 0.0)  # a debt stays; nothing is banked
            return
        share = BUSY_SHARE if busy else SHARE
        self._credit = min(self._credit + step_s * share / (1 - share), MAX_CREDIT_S)
        if self._credit <= 0:
            self.deferred_turns += 1
        while self._credit > 0 and go():
            t1 = self._clock()
            if not self._unit():
                break
            self._credit -= self._clock() - t1

    def _unit(self) -> bool:
        """One unit of storing or of the first stepped job, in turns; whether one ran."""
        self._storing_next = not self._storing_next
        if self._storing_next and self.storing.step():
            return True
        if self._stepped:
            self._advance()
            return True
        return self.storing.step()

    def _advance(self) -> bool:
        """One unit of the first stepped job; whether that job has more."""
        with self._cond:
            job = self._stepped[0] if self._stepped else None
        if job is None:
            return False
        try:
            if job.steps is None:
                if not job.fut.set_running_or_notify_cancel():
                    self._pop(job)
                    return False
                job.steps = job.make()
            next(job.steps)
            self.stepped_units += 1
            return True
        except StopIteration as done:
            self._pop(job)
            job.fut.set_result(done.value)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._pop(job)
            job.fut.set_exception(exc)
        return False

    def _pop(self, job: _Stepped) -> None:
        with self._cond:
            if self._stepped and self._stepped[0] is job:
                self._stepped.popleft()

    def close(self, exc: BaseException) -> None:
        """Shutting down: queued tasks and stepped jobs fail with `exc`; queued storing is dropped."""
        with self._cond:
            self._closed = True
            tasks, stepped = list(self._tasks), list(self._stepped)
            self._tasks.clear()
            self._stepped.clear()
        dropped = self.storing.clear()  # answered already; a later request that misses one queues it again
        if dropped:
            logger.info("shutting down: %d missed passages left unstored", dropped)
        for item in [*tasks, *stepped]:
            if not item.fut.done():
                item.fut.set_exception(exc)
        for job in stepped:
            if job.steps is not None:
                job.steps.close()

    def stats(self) -> dict:
        return {**self.storing.stats(), "tasks_queued": len(self._tasks), "stepped_queued": len(self._stepped),
                "stepped_units": self.stepped_units, "background_deferred_turns": self.deferred_turns,
                "background_held_turns": self.held_turns}


def _run_task(task: _Task) -> None:
    """One queued task: not started when its caller stopped while it waited."""
    if not task.fut.set_running_or_notify_cancel():
        return
    try:
        stop_if(task.should_stop, "while the task was queued")
        task.fut.set_result(task.fn())
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        task.fut.set_exception(exc)
