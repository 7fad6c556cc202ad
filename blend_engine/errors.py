"""Typed errors that decide who is at fault.

- `InputError` (a ValueError): the request cannot be served as asked (prompt longer than the
  model context, a segment that tokenizes to nothing). The service answers 4xx.
- `StorageError`: a store could not be read or written (disk full, unreadable index). Never the
  caller's fault: repaired where possible, else a logged, counted 5xx.
- `Overloaded`: the engine refused a request at admission (queue full, or the work ahead would
  outlast its deadline); the service answers 503 with Retry-After.
- `CorruptChunk` (a StorageError): a stored KV chunk that cannot be trusted; readers drop it and
  recompute, so a caller only sees a cache miss.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: the caller can fix it."""


class StorageError(RuntimeError):
    """A storage fault: not the caller's fault."""


class CorruptChunk(StorageError):
    """A stored KV chunk failed a consistency check."""


class Overloaded(RuntimeError):
    """Refused at admission (`scheduler.admission`): the caller may retry after `retry_after_s`."""

    def __init__(self, message: str, reason: str = "refused_queue_full", retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
