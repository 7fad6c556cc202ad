"""The engine loop's background storing of missed passages (`blend_engine.loop.storing`), alone: the
queue, its order, the share it takes while prefill work waits, storing on demand, failures."""

from __future__ import annotations

import pytest

from blend_engine.loop.storing import PassageStoring

LAYOUT = object()  # a layout: the store function only passes it on


def make(busy_stride: int = 3, fail: set[int] | None = None):
    calls: list[tuple[object, list[int], str | None]] = []

    def store(layout, missing, salt):
        if fail and missing[0] in fail:
            raise OSError("disk full")
        calls.append((layout, list(missing), salt))
        return len(missing)

    return PassageStoring(store, busy_stride), calls


def test_each_key_is_queued_once_and_stored_oldest_first():
    s, calls = make()
    assert s.add(LAYOUT, ["a", "b", None, "c"], [0, 1, 2, 3], "t") == 3  # the question (key None) is never stored
    assert s.add(LAYOUT, ["b", "d"], [0, 1], None) == 1  # "b" is queued already
    while s.step(busy=False):
        pass
    assert [c[1] for c in calls] == [[0], [1], [3], [1]]
    assert [c[2] for c in calls] == ["t", "t", "t", None]
    assert len(s) == 0 and s.stats()["store_done"] == 4


def test_while_prefill_work_waits_only_every_nth_turn_stores():
    s, calls = make(busy_stride=3)
    s.add(LAYOUT, ["a", "b"], [0, 1], None)
    stored = [s.step(busy=True) for _ in range(6)]
    assert stored == [False, False, True, False, False, True]
    assert s.stats()["store_deferred_turns"] == 4
    assert len(calls) == 2


def test_store_now_takes_only_the_queued_keys_asked_for():
    s, calls = make()
    s.add(LAYOUT, ["a", "b", "c"], [0, 1, 2], None)
    assert s.queued(["c", "x", None, "a"]) == ["c", "a"]
    assert s.store_now(["c", "x"]) is True
    assert [c[1] for c in calls] == [[2]]
    assert s.queued(["a", "b", "c"]) == ["a", "b"]
    assert s.store_now(["x", None]) is False  # neither queued nor stored lately: the plan stands


def test_a_key_stored_lately_makes_a_plan_stale():
    """A background turn stored it after the request was planned (a miss) and before it entered the
    batch: store_now says so, though nothing was queued any more."""
    s, calls = make()
    s.add(LAYOUT, ["a"], [0], None)
    assert s.step(busy=False)
    assert s.store_now(["a"]) is True and len(calls) == 1


def test_a_failed_store_is_counted_and_the_queue_goes_on():
    s, calls = make(fail={0})
    s.add(LAYOUT, ["a", "b"], [0, 1], None)
    assert s.step(busy=False) is False  # the failure is logged, not raised: the answer is out already
    assert s.step(busy=False) is True
    assert s.stats()["store_failed"] == 1 and [c[1] for c in calls] == [[1]]


def test_paused_turns_store_nothing_but_demand_still_does():
    s, calls = make()
    s.add(LAYOUT, ["a", "b"], [0, 1], None)
    s.paused = True
    assert not s.has_work and s.step(busy=False) is False and calls == []
    assert s.store_now(["b"]) is True
    s.paused = False
    assert s.has_work and s.step(busy=False) and len(s) == 0


def test_clear_drops_what_is_queued():
    s, calls = make()
    s.add(LAYOUT, ["a", "b"], [0, 1], None)
    assert s.clear() == 2 and len(s) == 0 and not s.has_work and calls == []


def test_busy_stride_must_be_positive():
    with pytest.raises(ValueError):
        PassageStoring(lambda *a: 0, busy_stride=0)
