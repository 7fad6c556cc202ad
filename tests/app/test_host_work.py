"""Queries' host work on a bounded pool of low-priority threads (`app.host_work`)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import sys
import threading

import pytest

from app.host_work import HostWork

REQUEST = contextvars.ContextVar("request", default=None)


def _where() -> tuple[str, int, str | None]:
    tid = threading.get_native_id()
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid), REQUEST.get()


def test_host_work_runs_on_its_own_niced_threads_in_the_callers_context():
    host = HostWork(threads=2, nice=7)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def main():
        REQUEST.set("r1")
        return await asyncio.gather(*(host.run(_where) for _ in range(6)))

    try:
        seen = asyncio.run(main())
    finally:
        host.close()
    names = {name for name, _, _ in seen}
    assert all(n.startswith("query-host") for n in names) and 1 <= len(names) <= 2  # bounded, reused
    if sys.platform == "linux":
        assert {prio for _, prio, _ in seen} == {min(base + 7, 19)}  # the engine's threads keep `base`
    assert {req for _, _, req in seen} == {"r1"}  # log fields and the like follow the request


def test_nice_zero_keeps_the_priority_and_bad_sizes_fail_fast():
    host = HostWork(threads=1, nice=0)
    try:
        _, prio, _ = asyncio.run(host.run(_where))
        assert prio == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    finally:
        host.close()
    with pytest.raises(ValueError):
        HostWork(threads=0, nice=5)
    with pytest.raises(ValueError):
        HostWork(threads=1, nice=20)


def _policy() -> tuple[int, int]:
    return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_idle_threads_run_under_sched_idle_and_the_callers_policy_is_untouched():
    host = HostWork(threads=1, nice=19, idle=True)
    try:
        policy, prio = asyncio.run(host.run(_policy))
    finally:
        host.close()
    assert policy == os.SCHED_IDLE and prio == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this thread (the engine's side) keeps the normal policy
    host = HostWork(threads=1, nice=19)  # not idle: niced
    try:
        policy, prio = asyncio.run(host.run(_policy))
    finally:
        host.close()
    assert policy == os.SCHED_OTHER and prio == min(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + 19, 19)


class _Background:
    """Counts holds the way `Background.hold/release` would see them."""

    def __init__(self) -> None:
        self.holds = 0

    def hold(self) -> None:
        self.holds += 1

    def release(self) -> None:
        self.holds -= 1


def test_background_is_held_while_a_call_is_queued_or_running_and_released_on_error():
    host = HostWork(threads=1, nice=0)
    bg = _Background()
    host.yields_to(bg)
    release_first = threading.Event()

    def first():
        release_first.wait(5)
        return bg.holds

    def boom():
        raise ValueError("bad query")

    async def main():
        a = asyncio.ensure_future(host.run(first))
        b = asyncio.ensure_future(host.run(lambda: bg.holds))  # queued behind `first` on the one thread
        await asyncio.sleep(0)
        held_while_queued = bg.holds
        release_first.set()
        seen = [*await asyncio.gather(a, b), await host.run(lambda: bg.holds)]
        with pytest.raises(ValueError, match="bad query"):
            await host.run(boom)
        return held_while_queued, seen

    try:
        held_while_queued, seen = asyncio.run(main())
    finally:
        host.close()
    assert held_while_queued == 2 and seen[0] == 2 and seen[2] == 1  # the first saw the queued one's hold
    assert bg.holds == 0  # every hold released, the failed call's too
