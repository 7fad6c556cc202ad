"""The engine loop's background storing of missed passages (`blend_engine.loop.storing`), alone: the
queue, its order, a passage a layer a unit, storing on demand (finishing one half done), failures."""

from __future__ import annotations

from dataclasses import dataclass

from blend_engine.loop.storing import PassageStoring

LAYERS = 3  # units per passage in these fakes


@dataclass(frozen=True)
class _Seg:
    token_ids: tuple[int, ...]


class _Layout:
    """A layout whose segment i holds the token ids (i,)."""

    segments = [_Seg((i,)) for i in range(8)]


LAYOUT = _Layout()


def make(fail: set[int] | None = None):
    """A storing queue over a fake stepped store: each passage takes LAYERS units, then one write
    (`writes`, with its salt); `units` records every unit's passage."""
    writes: list[tuple[int, str | None]] = []
    units: list[int] = []

    def store_steps(token_ids, salt):
        (i,) = token_ids
        for layer in range(LAYERS):
            if layer:
                yield  # between two layers
            units.append(i)
            if fail and i in fail:
                raise OSError("disk full")
        writes.append((i, salt))
        return True

    return PassageStoring(store_steps), writes, units


def drain_units(s: PassageStoring) -> int:
    n = 0
    while s.step():
        n += 1
    return n


def test_each_key_is_queued_once_and_stored_oldest_first_a_layer_a_unit():
    s, writes, units = make()
    assert s.add(LAYOUT, ["a", "b", None, "c"], [0, 1, 2, 3], "t") == 3  # the question (key None) is never stored
    assert s.add(LAYOUT, ["b", "d"], [0, 1], None) == 1  # "b" is queued already
    assert drain_units(s) == 4 * LAYERS
    assert writes == [(0, "t"), (1, "t"), (3, "t"), (1, None)]
    assert units == [0] * LAYERS + [1] * LAYERS + [3] * LAYERS + [1] * LAYERS
    assert len(s) == 0 and s.stats()["store_done"] == 4 and s.stats()["store_units"] == 4 * LAYERS


def test_a_passage_is_written_only_after_its_last_layer():
    s, writes, _ = make()
    s.add(LAYOUT, ["a"], [0], None)
    for _ in range(LAYERS - 1):
        assert s.step() and writes == []
    assert s.step() and writes == [(0, None)]  # the last layer's unit writes it
    assert not s.step() and len(s) == 0


def test_a_passage_in_progress_is_not_queued_again():
    s, writes, _ = make()
    s.add(LAYOUT, ["a"], [0], None)
    s.step()  # "a" is half done
    assert s.add(LAYOUT, ["a"], [0], None) == 0 and s.queued(["a"]) == ["a"] and len(s) == 1
    drain_units(s)
    assert writes == [(0, None)]


def test_store_now_takes_only_the_queued_keys_asked_for():
    s, writes, _ = make()
    s.add(LAYOUT, ["a", "b", "c"], [0, 1, 2], None)
    assert s.queued(["c", "x", None, "a"]) == ["c", "a"]
    assert s.store_now(["c", "x"]) is True
    assert writes == [(2, None)]
    assert s.queued(["a", "b", "c"]) == ["a", "b"]
    assert s.store_now(["x", None]) is False  # neither queued nor stored lately: the plan stands


def test_store_now_finishes_a_half_done_passage_from_its_next_layer():
    """Never computed twice: the layers the background ran are kept."""
    s, writes, units = make()
    s.add(LAYOUT, ["a", "b"], [0, 1], None)
    s.step()
    s.step()
    assert s.store_now(["a"]) is True
    assert writes == [(0, None)] and units == [0] * LAYERS  # LAYERS units in all, not 2 + LAYERS
    assert s.queued(["a", "b"]) == ["b"]


def test_a_key_stored_lately_makes_a_plan_stale():
    """A background unit stored it after the request was planned (a miss) and before it entered the
    batch: store_now says so, though nothing was queued any more."""
    s, writes, _ = make()
    s.add(LAYOUT, ["a"], [0], None)
    drain_units(s)
    assert s.store_now(["a"]) is True and len(writes) == 1


def test_a_failed_store_is_counted_and_the_queue_goes_on():
    s, writes, _ = make(fail={0})
    s.add(LAYOUT, ["a", "b"], [0, 1], None)
    assert s.step()  # the failure is logged, not raised: the answer is out already
    drain_units(s)
    assert s.stats()["store_failed"] == 1 and writes == [(1, None)]
    assert s.store_now(["a"]) is False  # a failed key is not "stored lately"


def test_paused_units_store_nothing_but_demand_still_does():
    s, writes, _ = make()
    s.add(LAYOUT, ["a", "b"], [0, 1], None)
    s.paused = True
    assert not s.has_work and s.step() is False and writes == []
    assert s.store_now(["b"]) is True
    s.paused = False
    assert s.has_work and drain_units(s) == LAYERS and len(s) == 0


def test_clear_drops_what_is_queued_and_in_progress_without_writing():
    s, writes, _ = make()
    s.add(LAYOUT, ["a", "b"], [0, 1], None)
    s.step()
    assert s.clear() == 2 and len(s) == 0 and not s.has_work and writes == []
