"""The host side of a query (retrieval, embedding, the cross-encoder rerank, tokenizing, layout and
block hashing) on a few threads of its own, at a lower CPU priority than the engine loop.

    event loop:   route -> await host.run(_passages) -> await host.run(_prepared) -> engine client
    query threads (`threads`, nice +`nice`):   one core each (`cpu_threads`), queued beyond `threads`
    engine loop thread (nice 0) and its OpenMP team: every core

On a host whose cores the engine loop already keeps busy, host work competes with the decode step
for them. The engine computes with a team of threads that meet at a barrier after each of a step's
~400 ops: one team thread preempted by a retrieval thread stalls the whole op. Measured on 2 cores
(`benchmarks.load.stream_gap`, 8 clients posting reranked questions beside a stream): a decode step
took 1,768 ms instead of 19 ms with retrieval on Starlette's thread pool (up to 40 threads at the
same priority). So host work runs on `threads` threads only (the rest wait in this pool's queue:
that wait is part of their `retrieval_ms`), each niced by `nice` (Linux: per thread), so the
scheduler lets the engine's threads preempt them; they use what the engine leaves. Same benchmark,
2 query threads: decode step 23.7 ms and gap p99 295 ms at nice +10, 20.5 ms and 82.8 ms (quiet:
60 ms) at +19, 75 reranked answers in both runs (docs/results.md). A niced thread is preempted only
once the waking thread's lead passes the scheduler's wake-up granularity, so now and then a team
thread waited and a decode step took 100-200 ms (its GEMMs 10x slower). So by default (`idle`) they
run under Linux's SCHED_IDLE policy, where a waking normal thread preempts at once: gap p99 1.42x quiet
against 2.64x niced (docs/results.md). Such a thread would also wait for the engine loop's background
work (storing missed passages runs whenever no request does: the same prompt again right after a cold
one waited 545 ms instead of ~100), so while any call is queued or running here the loop holds its
background units (`yields_to`, `Background.hold`; after that change the repeat took at most 166 ms).
The price: a new question waits behind the queued ones while the engine is busy (a stream's TTFT
under that load 11-17 s, 17.8-18.7 s niced).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from blend_engine.model.cpu_threads import one_core

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Yields(Protocol):
    """What makes way while host work runs (the engine loop's background units: `Background.hold`)."""

    def hold(self) -> None: ...

    def release(self) -> None: ...


class HostWork:
    """A bounded pool of low-priority threads for queries' host work; `run` awaits one call on it.
    Once `yields_to` names the engine loop's background, its units (storing missed passages, the
    fidelity gate's prefills) wait while any call is queued or running here, so a query's host work
    never waits behind work that only helps later requests."""

    def __init__(self, threads: int, nice: int, idle: bool = False) -> None:
        if threads < 1 or not 0 <= nice <= 19:
            raise ValueError(f"query threads must be >= 1 and nice within 0..19, not {threads} and {nice}")
        self.threads, self.nice, self.idle = threads, nice, idle
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="query-host",
                                                           initializer=self._enter)
        self._yields: Yields | None = None

    def yields_to(self, background: Yields) -> None:
        """From now on `background` holds its units while a call is in flight here."""
        self._yields = background

    def _enter(self) -> None:
        """Each pool thread, once: one core for its torch ops, a lower priority than the engine loop."""
        one_core()
        if self.idle and _sched_idle():
            return
        if self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (AttributeError, OSError) as exc:  # not Linux, or not allowed: said once per thread
                logger.warning("query threads keep the engine's CPU priority (nice +%d failed: %s)", self.nice, exc)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on a pool thread, in the caller's context (its log fields)."""
        ctx = contextvars.copy_context()
        call = functools.partial(ctx.run, fn, *args)
        background = self._yields
        if background is not None:
            background.hold()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        finally:
            if background is not None:
                background.release()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _sched_idle() -> bool:
    """The calling thread runs only on CPU no other thread wants (Linux SCHED_IDLE: a waking thread of
    normal policy preempts it at once); False (said once per thread) where that is not available."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return True
    except (AttributeError, OSError) as exc:
        logger.warning("query threads are niced instead of SCHED_IDLE (%s)", exc)
        return False
