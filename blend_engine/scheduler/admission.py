"""The one admission point: whether a request is taken, waits, or is refused, and why. Torch-free.

A request meets admission twice, both here:

    submit   (the caller's side) refused at once when the queue is full beyond the batch's free
             places (`queue_full`) or when the work ahead of it plus its own cannot end before
             its deadline (`too_slow`): a 503 with Retry-After, never a 504 later
    start    (the engine loop, each step) a waiting request is dropped unstarted when its time
             left is shorter than a request takes (`too_late`); the head of the queue waits
             while the batch is full (`batch_has_room`) or the KV pool has no run of free
             blocks for its prompt (`BatchScheduler._place`, the pool's own rule)

Each rule is one function of plain numbers. `AdmissionControl` holds the numbers they read (the
queue's length, the moving average of a request's cost) and counts every decision by its reason
(`DECISIONS`), the metric family that says why a request waited or was refused.

A request's cost is its share of the engine loop's time: each step's time divided among the
requests in the batch. The loop is one server that everything in it shares, so the work ahead of
a new request takes about cost x (requests ahead), whatever the batch size: batching shows up as
a lower cost per request, measured, never assumed. (With a request's wall time as its cost and
the batch as parallel servers, a loaded CPU admitted all it could and every request timed out.)
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from blend_engine.errors import Overloaded

# every reason a request was taken, waited or refused: the labels of one metric family
DECISIONS = ("admitted", "refused_queue_full", "refused_too_slow", "refused_shutting_down",
             "dropped_too_late", "waited_batch_full", "waited_kv_blocks",
             "waited_step_budget")


# ---------------------------------------------------------------------- the rules
def queue_full(waiting: int, max_queue: int | None, free_places: int = 0) -> bool:
    """No room to wait: `max_queue` requests already wait beyond the batch's `free_places` (those
    the next step admits: a request that ended frees its place a step before the queue's head
    takes it, and a client asking again at once must not find the queue full; None: no bound)."""
    return max_queue is not None and waiting - free_places >= max_queue


def free_places(running: int, max_batch: int | None) -> int:
    """Places in the batch that no running request holds (0 where the batch's size is not known)."""
    return 0 if max_batch is None else max(0, max_batch - running)


def predictable(took_s: float | None, timeout_s: float | None) -> bool:
    """Requests usually end within this timeout. Otherwise (none measured yet, no timeout, or they
    usually run longer) nothing is refused or dropped on estimates, so a stale one never starves."""
    return timeout_s is not None and took_s is not None and took_s < timeout_s


def expected_wait_s(took_s: float, waiting: int, running: int, parallel: int) -> float:
    """Until a request submitted now would end: the requests ahead of it, `parallel` servers
    working through them (1 for the engine loop, whose cost is a share of it), then itself."""
    return took_s * (1 + (waiting + running) / parallel)


def too_slow(took_s: float | None, waiting: int, running: int, parallel: int, timeout_s: float | None) -> bool:
    """The work ahead plus its own would end after its deadline: refuse now, not with a 504 later."""
    if not predictable(took_s, timeout_s) or waiting + running == 0:
        return False
    return expected_wait_s(took_s, waiting, running, parallel) > timeout_s


def too_late(took_s: float | None, time_left_s: float | None, timeout_s: float | None) -> bool:
    """A queued request whose time left is shorter than a request takes: starting it would only
    produce a 504."""
    return predictable(took_s, timeout_s) and time_left_s is not None and time_left_s < took_s


def batch_has_room(running: int, max_batch: int) -> bool:
    return free_places(running, max_batch) > 0


def moving_average(old: float | None, new: float, weight: float = 0.3) -> float:
    """The estimates' update (the scheduler's every moving average): one more measurement weighs
    `weight` (the first is taken as it is)."""
    return new if old is None else (1 - weight) * old + weight * new


# ---------------------------------------------------------------------- the state the rules read
class Ticket:
    """A request's place in the queue, taken before its prompt is built: the engine loop's `submit`
    uses it; `release` gives it back when the request never gets there (retrieval failed)."""

    def __init__(self, control: AdmissionControl) -> None:
        self._control = control
        self._open = True
        self._lock = threading.Lock()

    def use(self) -> None:
        with self._lock:
            if not self._open:
                raise RuntimeError("an admission ticket is used once")
            self._open = False

    def release(self) -> None:
        """No-op once used or released."""
        with self._lock:
            was_open, self._open = self._open, False
        if was_open:
            self._control.left_queue()


@dataclass(frozen=True)
class AdmissionLimits:
    max_queue: int | None = None  # requests waiting beyond the batch's free places before 503 (None: no bound)
    max_batch: int | None = None  # the batch's places (`BatchLimits.max_batch`; None: free places not counted)

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")


class AdmissionControl:
    """Queue length, the moving average of a request's time, and the decision counts. Thread-safe:
    the caller's side submits, the engine loop starts and finishes requests."""

    def __init__(self, limits: AdmissionLimits, took_s: float | None = None) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._queued = 0  # submitted, not started (or dropped) yet
        self._running = 0
        self._places = 0  # the batch's places the running requests hold: one per sequence (a request's n)
        self._took_s = took_s  # a request's cost: its share of the loop (moving average); None until one completed
        self._closed = False
        self.decisions: Counter[str] = Counter({d: 0 for d in DECISIONS})

    # ------------------------------------------------------------------ caller side
    def admit(self, timeout_s: float | None) -> Ticket:
        """Take a request into the queue, or raise `Overloaded` (queue full, too slow, shutting down).
        Called before the request's prompt is built, so a refusal costs no retrieval."""
        with self._lock:
            refusal = self._refusal(timeout_s)
            if refusal is not None:
                reason, message = refusal
                self.decisions[reason] += 1
                raise Overloaded(message, reason)
            self._queued += 1
        return Ticket(self)

    def _refusal(self, timeout_s: float | None) -> tuple[str, str] | None:
        lim = self.limits
        if self._closed:
            return "refused_shutting_down", "the engine is shutting down"
        if queue_full(self._queued, lim.max_queue, free_places(self._places, lim.max_batch)):
            return "refused_queue_full", f"engine queue is full ({lim.max_queue} waiting)"
        if too_slow(self._took_s, self._queued, self._running, 1, timeout_s):
            wait = expected_wait_s(self._took_s, self._queued, self._running, 1)
            return "refused_too_slow", (f"engine busy: the work ahead would take about {wait:.1f} s, longer than "
                                        f"the request's {timeout_s:g} s timeout")
        return None

    # ------------------------------------------------------------------ engine-loop side
    def too_late(self, time_left_s: float | None, timeout_s: float | None) -> bool:
        """A queued request could not end in its time left, sharing the loop with those running."""
        with self._lock:
            need = None if self._took_s is None else expected_wait_s(self._took_s, 0, self._running, 1)
            return too_late(need, time_left_s, timeout_s)  # need >= a request's cost: predictable(need) implies it

    def started(self, places: int = 1) -> None:
        """A queued request was admitted to the batch, where its sequences take `places` (its n)."""
        with self._lock:
            self._queued -= 1
            self._running += 1
            self._places += places
            self.decisions["admitted"] += 1

    def left_queue(self, reason: str | None = None) -> None:
        """A queued request ended before it started (cancelled, failed; `reason` when admission dropped it)."""
        with self._lock:
            self._queued -= 1
            if reason is not None:
                self.decisions[reason] += 1

    def finished(self, seconds: float | None, places: int = 1) -> None:
        """A started request ended, giving back its `places`; `seconds` (its share of the loop) teaches the
        moving average when it completed."""
        with self._lock:
            self._running -= 1
            self._places -= places
        if seconds is not None:
            self.learn(seconds)

    def learn(self, seconds: float) -> None:
        """One more completed request cost `seconds` of the loop (the moving average)."""
        with self._lock:
            self._took_s = moving_average(self._took_s, seconds)

    def waited(self, reason: str) -> None:
        """A request at the head of the queue waited a step for `reason` (`waited_*`)."""
        with self._lock:
            self.decisions[reason] += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True

    # ------------------------------------------------------------------ introspection
    @property
    def queued(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return self._running

    @property
    def places(self) -> int:
        return self._places

    @property
    def took_s(self) -> float | None:
        return self._took_s
