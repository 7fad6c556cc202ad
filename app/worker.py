"""A bounded queue in front of worker threads for blocking jobs: document ingestion and store
verification (queries do not come here: they await the engine client, `blend_engine.client`).

The event loop never runs these: routes submit a job (a plain function) and await its future.
When `max_queue` jobs are already waiting, `submit` raises `Overloaded` at once (503).
A job can be cancelled, and it has a deadline (its request's timeout): a queued job that is
cancelled or past its deadline is never started; a running one stops at its next check (its
function is handed the job: `lambda: job.cancelled` is its stop check, ingestion makes it between
batches). Work that commits (ingestion) calls `job.begin_commit()` first: from
then on a cancel is refused, so a request is either told it failed and nothing was committed, or
it waits the few milliseconds the commit takes and gets its answer.

Admission by expected time, by the engine's rules (`blend_engine.scheduler.admission`): the worker
keeps a moving average of how long each kind of job (its name) takes. A job with a deadline is
refused at once (`Overloaded`, a 503 with Retry-After) when the work ahead of it plus its own
cannot finish before that deadline, and a queued job is not started when the time it has left is
shorter than such a job takes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from blend_engine.cancel import Cancelled
from blend_engine.errors import Overloaded
from blend_engine.scheduler.admission import expected_wait_s, moving_average, too_late, too_slow

__all__ = ["Cancelled", "EngineWorker", "Job"]

logger = logging.getLogger(__name__)


class Job:
    """One unit of engine work. `fn(job)` runs on a worker thread; its return value is the result."""

    def __init__(self, fn: Callable[[Job], Any], name: str = "job", timeout_s: float | None = None) -> None:
        self.fn = fn
        self.name = name
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.submitted = time.perf_counter()
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.started: float | None = None
        self._cancel = threading.Event()
        self._commit_lock = threading.Lock()
        self._committing = False

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    @property
    def timed_out(self) -> bool:
        """Past its deadline and never asked to stop: what stopped it is its request's timeout."""
        return self.expired and not self._cancel.is_set()

    @property
    def cancelled(self) -> bool:
        """Cancelled, or past its deadline (unless it already began committing)."""
        return self._cancel.is_set() or (self.expired and not self._committing)

    def cancel(self) -> bool:
        """Ask the job to stop. False when it is too late: the job has begun committing."""
        with self._commit_lock:
            if self._committing:
                return False
            self._cancel.set()
            return True

    def begin_commit(self) -> None:
        """Called by work right before it commits: raises Cancelled when cancelled or past its deadline,
        else makes the job uncancellable (its request waits for the commit instead of timing out)."""
        with self._commit_lock:
            if self._cancel.is_set() or self.expired:
                raise Cancelled(f"{self.name} cancelled before it committed")
            self._committing = True

    @property
    def queue_ms(self) -> float:
        end = self.started if self.started is not None else time.perf_counter()
        return (end - self.submitted) * 1e3


class EngineWorker:
    """`workers` threads draining a queue of at most `max_queue` waiting jobs."""

    def __init__(self, workers: int = 1, max_queue: int = 16, name: str = "engine") -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._active: set[Job] = set()
        self._closed = False
        self.max_queue = max_queue
        self._workers = workers
        self._took: dict[str, float] = {}  # job name -> moving average of its run time (s)
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-worker-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ introspection
    @property
    def depth(self) -> int:
        """Jobs waiting for a worker."""
        return self._queue.qsize()

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._active)

    def expected_s(self, name: str) -> float | None:
        """How long a job of this kind takes (moving average), or None before the first one finished."""
        with self._lock:
            return self._took.get(name)

    def expected_wait_s(self, name: str) -> float | None:
        """Until a job of this kind submitted now would finish: the jobs ahead shared by the workers, plus itself."""
        took = self.expected_s(name)
        return None if took is None else expected_wait_s(took, self.depth, self.running, self._workers)

    def _learn(self, job: Job, seconds: float) -> None:
        with self._lock:
            self._took[job.name] = moving_average(self._took.get(job.name), seconds)

    def _too_late(self, job: Job) -> bool:
        """Its time left is shorter than such a job takes: starting it would only produce a 504."""
        left = None if job.deadline is None else job.deadline - time.monotonic()
        return too_late(self.expected_s(job.name), left, job.timeout_s)

    # ------------------------------------------------------------------ submission
    def submit(self, fn: Callable[[Job], Any], name: str = "job", timeout_s: float | None = None) -> Job:
        """Queue `fn`; with `timeout_s` the job has a deadline past which it is not started or stops."""
        if self._closed:
            raise Overloaded("the engine is shutting down")
        job = Job(fn, name, timeout_s)
        if too_slow(self.expected_s(name), self.depth, self.running, self._workers, timeout_s):
            wait = self.expected_wait_s(name)
            raise Overloaded(f"engine busy: the work ahead would take about {wait:.1f} s, longer than the "
                            f"request's {timeout_s:g} s timeout")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(f"engine queue is full ({self.max_queue} waiting)") from None
        return job

    async def run(self, fn: Callable[[Job], Any], timeout_s: float, name: str = "job") -> Any:
        """Submit and await the result; on timeout or caller cancellation the job is cancelled.

        A job already committing cannot be cancelled: then its result is awaited after all. A job
        that stopped at its own deadline (it checks it between layers and batches, and its deadline
        starts before this wait's timer) is a timeout too, whichever of the two fires first."""
        job = self.submit(fn, name, timeout_s)
        result = asyncio.wrap_future(job.future)
        result.add_done_callback(_consume)  # an abandoned job's late error is not "never retrieved"
        try:
            return await asyncio.wait_for(asyncio.shield(result), timeout_s)
        except Cancelled:
            if job.timed_out:
                raise TimeoutError(f"{name} stopped at its deadline") from None
            raise
        except BaseException:
            if job.cancel():
                raise
        return await result

    # ------------------------------------------------------------------ the worker loop
    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            late = self._too_late(job)
            if job.cancelled or late or not job.future.set_running_or_notify_cancel():
                if not job.future.done():
                    why = "its deadline passed" if job.expired else \
                        "it could not finish before its deadline" if late else "it was cancelled"
                    job.future.set_exception(Cancelled(f"{job.name} not started: {why} while queued"))
                continue
            job.started = time.perf_counter()
            with self._lock:
                self._active.add(job)
            error: BaseException | None = None
            try:
                result = job.fn(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                error, result = exc, None
            if error is None:
                self._learn(job, time.perf_counter() - job.started)
            with self._lock:  # free the slot before anyone can see the outcome
                self._active.discard(job)
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel waiting jobs, let running ones see their cancel flag, join the threads."""
        self._closed = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(Cancelled("server shutting down"))
        with self._lock:
            for job in self._active:
                job.cancel()
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                logger.warning("worker %s still busy at shutdown", t.name)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
