"""The engine loop's background work: whatever runs the model for something other than a request in the
batch, on the loop's thread, between its steps (the one thread that computes; `cpu_threads`).

    loop turn:  | step (the batch) | one task | one storing unit | stepped-job units |
                                     ingestion    a missed passage  a layer of a fidelity-gate
                                     precompute   stored            prefill (or one chunk cached)

- **tasks** (`run_task`): a callable run whole between two steps (ingestion's KV precompute, its
  embedding batches); one per turn.
- **storing** (`storing.PassageStoring`): missed passages' alone-KV, stored after their answers.
- **stepped jobs** (`run_stepped`): a generator advanced a unit at a time, so that a long job (the
  start-up fidelity gate: ~20 prefills) delays a request by one unit, never by the whole job: one unit
  a turn while requests are in the batch; with none, units for as long as the turn's task ran (at
  least `IDLE_SLICE_S`), so the job shares the loop evenly with ingestion.

Storing and stepped jobs yield to requests: while prefill work waits they take one turn in
`busy_stride`. Callers on other threads block on a future; on the loop's own thread, or before the
loop started, the work runs directly on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from blend_engine.cancel import Cancelled, StopCheck, stop_if
from blend_engine.loop.storing import PassageStoring, StoreFn

logger = logging.getLogger(__name__)
T = TypeVar("T")
Steps = Generator[None, None, T]  # a stepped job: yields between units, returns its result
IDLE_SLICE_S = 0.05  # a stepped job's least time a turn while no request is in the batch


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
    when work arrives); `loop_thread()` its thread, None before it started."""

    def __init__(self, cond: threading.Condition, loop_thread: Callable[[], threading.Thread | None],
                 store: StoreFn, busy_stride: int = 4) -> None:
        if busy_stride < 1:
            raise ValueError("busy_stride must be >= 1")
        self._cond, self._loop_thread, self.busy_stride = cond, loop_thread, busy_stride
        self.storing = PassageStoring(store, busy_stride)
        self._tasks: deque[_Task] = deque()
        self._stepped: deque[_Stepped] = deque()
        self._closed = False
        self._turns = 0
        self.stepped_units = self.stepped_deferred = 0  # counters for stats

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
        """Anything for a turn (the loop sleeps when neither this nor the batch has work). Under `cond`."""
        return bool(self._tasks) or bool(self._stepped) or self.storing.has_work

    def turn(self, busy: bool, idle: bool = False) -> None:
        """One loop turn's background work, after the step: a task, a passage stored, stepped units.
        With requests in the batch a stepped job gets one unit (one turn in `busy_stride` while `busy`:
        prefill work waits); with none (`idle`) it runs for as long as this turn's task did, at least
        `IDLE_SLICE_S`, so it shares the loop evenly with ingestion and a new request waits one slice."""
        t0 = time.perf_counter()
        with self._cond:
            task = self._tasks.popleft() if self._tasks else None
        if task is not None:
            _run_task(task)
        task_s = time.perf_counter() - t0
        self.storing.step(busy)
        self._turns += 1
        if self._stepped and busy and self._turns % self.busy_stride:
            self.stepped_deferred += 1
            return
        deadline = time.perf_counter() + max(task_s, IDLE_SLICE_S)
        while self._advance() and idle and time.perf_counter() < deadline:
            pass

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
                "stepped_units": self.stepped_units, "stepped_deferred_turns": self.stepped_deferred}


def _run_task(task: _Task) -> None:
    """One queued task: not started when its caller stopped while it waited."""
    if not task.fut.set_running_or_notify_cancel():
        return
    try:
        stop_if(task.should_stop, "while the task was queued")
        task.fut.set_result(task.fn())
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        task.fut.set_exception(exc)


def drain(steps: Steps[T]) -> T:
    """Run a stepped job to its end on this thread."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
