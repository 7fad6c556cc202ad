"""Cooperative cancellation, explicit: work that can be stopped takes a `should_stop: StopCheck`
and calls `stop_if(should_stop, where)` at its safe points (between layers, precompute forwards
and ingestion batches). A request's handle carries its own abort (`Generation.cancel`,
`client.RequestStream.abort`) and its deadline; no state is kept per thread.
"""

from __future__ import annotations

from collections.abc import Callable


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
