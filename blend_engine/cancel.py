"""Cooperative cancellation of engine work, checked between layers.

Explicit form (the one to use): work takes a `should_stop: StopCheck` parameter and calls
`stop_if(should_stop, where)` at its safe points. The thread-local scope below is being retired.

A worker runs each job inside `cancel_scope(should_stop)`; the engine calls `checkpoint()` at
every layer of a prefill or precompute (and ingestion between batches), which raises `Cancelled`
once `should_stop()` is true (the request timed out, the client left, the server is stopping).
Outside a scope `checkpoint()` does nothing, so library and CLI use are unaffected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


class Cancelled(Exception):
    """The work was cancelled (timeout, client gone, shutdown) before or while it ran."""


class DeadlineExceeded(Cancelled):
    """The work stopped (or was never started) because its request's deadline passed."""


StopCheck = Callable[[], bool]  # true once the work should stop (timeout, client gone, shutdown)


def never() -> bool:
    """The `StopCheck` of work nobody cancels (a CLI run, a test)."""
    return False


def stop_if(should_stop: StopCheck | None, where: str = "") -> None:
    """Raise `Cancelled` at a safe point of work whose `should_stop()` is true."""
    if should_stop is not None and should_stop():
        raise Cancelled(f"cancelled{' ' + where if where else ''}")


@contextmanager
def cancel_scope(should_stop: Callable[[], bool]) -> Iterator[None]:
    """Make `checkpoint()` on this thread raise once `should_stop()` is true."""
    previous = getattr(_local, "check", None)
    _local.check = should_stop
    try:
        yield
    finally:
        _local.check = previous


def checkpoint(where: str = "") -> None:
    """Raise `Cancelled` when the current scope's work should stop."""
    check = getattr(_local, "check", None)
    if check is not None and check():
        raise Cancelled(f"cancelled{' ' + where if where else ''}")


def current_check() -> Callable[[], bool] | None:
    """The current scope's `should_stop` on this thread (None outside a scope): work handed to
    another thread (the engine loop) carries it along."""
    return getattr(_local, "check", None)
