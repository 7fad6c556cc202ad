"""Typed errors that decide who is at fault.

- `InputError` (a ValueError): the request cannot be served as asked (prompt longer than the
  model context, a segment that tokenizes to nothing). The service answers 4xx.
- `StorageError`: a store could not be read or written (disk full, unreadable index). Never the
  caller's fault: repaired where possible, else a logged, counted 5xx.
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
