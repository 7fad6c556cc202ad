"""A benchmark client that does not time its own garbage collector.

A client that has loaded datasets, tokenizers and models holds a few hundred thousand Python objects;
one full (generation-2) collection of them took 131-166 ms in `benchmarks.load.stream_gap`'s client on
the 2-core dev host, a pause that lands in whatever gap or first token the client is timing (an SSE
event read late looks like the server's stall). `no_gc_pauses()` collects once, freezes what exists
(`gc.freeze`: later collections do not traverse it) and disables the collector for the timed block,
as `timeit` does; on exit the collector is back as it was and the frozen objects are unfrozen.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_gc_pauses() -> Iterator[None]:
    """The block runs with the collector off and the objects made before it frozen."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
