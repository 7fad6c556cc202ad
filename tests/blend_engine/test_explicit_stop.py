"""Explicit cancellation of precompute work: a `should_stop` parameter, never a thread-local scope."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from blend_engine.cancel import Cancelled
from blend_engine.engine import BlendEngine
from blend_engine.executor.layers import LayerJob, run_layers
from blend_engine.kv_store import MemoryStore
from blend_engine.types import BlendPlan, GenerationConfig

WAIT_S = 30.0  # the most any event below is waited for; every wait ends as soon as it is set


@pytest.fixture
def engine(tiny_runner):
    eng = BlendEngine(tiny_runner, MemoryStore(1 << 26))
    yield eng
    eng.close()


def _ids(engine: BlendEngine, text: str) -> list[int]:
    return engine.passage_tokens(text)


def _counting_stop(stop_at: int) -> tuple[list[int], Callable[[], bool]]:
    """A `should_stop` true from its `stop_at`-th call on; the list counts its calls."""
    calls: list[int] = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) >= stop_at

    return calls, should_stop


def test_precompute_stops_before_the_layer_where_should_stop_turns_true(engine):
    ids = _ids(engine, "The lighthouse keeper logged the storm at dawn.")
    calls, stop = _counting_stop(3)
    with pytest.raises(Cancelled, match="at layer 2 of a precompute"):
        engine.chunks.precompute(ids, stop)
    assert len(calls) == 3  # checked once per layer, before it runs
    with torch.inference_mode():  # as the engine runs it (with a gradient to take, projections skip cpu_kernels)
        ref = run_layers(engine.runner, LayerJob(torch.tensor(ids))).cache.segment(0, len(ids))  # k, v: [L, H, T, D]
    calls, stop = _counting_stop(10 ** 6)
    kv = engine.chunks.precompute(ids, stop)  # never true: the same KV as the plain layer loop
    assert len(calls) == engine.runner.shape.n_layers
    torch.testing.assert_close(kv.k, ref.k, rtol=0, atol=0)
    torch.testing.assert_close(kv.v, ref.v, rtol=0, atol=0)


def test_cache_many_stops_between_forwards_and_keeps_what_it_stored(engine):
    lists = [_ids(engine, f"Passage {i} is about the river number {i}.") for i in range(5)]

    def stored() -> list[bool]:
        return [engine.store.contains(engine.key_of(ids)) for ids in lists]

    with pytest.raises(Cancelled, match="between precompute batches"):  # true once two forwards are stored
        engine.cache_many(lists, batch_size=2, should_stop=lambda: sum(stored()) >= 4)
    assert sum(stored()) == 4  # the third forward (the fifth passage) never ran
    before = stored()
    assert engine.cache_many(lists, batch_size=2) == [not s for s in before]  # the rest, without a stop
    assert all(stored())


def _start_loop(engine: BlendEngine) -> None:
    """A first request starts the engine loop thread (before it, tasks run on the caller's thread)."""
    engine.run(BlendPlan(passages=("A short passage.",), question="Why?"), GenerationConfig(max_tokens=1))
    assert engine.loop._thread is not None and engine.loop._thread.is_alive()


def _wait_queued(engine: BlendEngine, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while engine.loop.stats()["tasks_queued"] < n:
        assert time.monotonic() < deadline, "the task was never queued"
        time.sleep(0.005)


def test_a_queued_task_whose_stop_is_set_is_never_run(engine):
    _start_loop(engine)
    entered, release, stop = threading.Event(), threading.Event(), threading.Event()
    ran: list[str] = []
    outcome: dict[str, object] = {}

    def blocker() -> str:  # holds the loop so that the next task waits in its queue
        entered.set()
        release.wait(WAIT_S)
        return "blocker"

    def call(name: str, fn, should_stop) -> None:
        try:
            outcome[name] = engine.loop.run_task(fn, should_stop)
        except Cancelled as exc:
            outcome[name] = exc

    first = threading.Thread(target=call, args=("blocker", blocker, None))
    first.start()
    assert entered.wait(WAIT_S)
    second = threading.Thread(target=call, args=("stopped", lambda: ran.append("stopped"), stop.is_set))
    second.start()
    _wait_queued(engine, 1)
    stop.set()  # the caller stops while its task waits
    release.set()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert outcome["blocker"] == "blocker"
    assert isinstance(outcome["stopped"], Cancelled) and "queued" in str(outcome["stopped"])
    assert ran == []
    assert engine.loop.run_task(lambda: "after", threading.Event().is_set) == "after"  # the loop goes on


def test_run_task_before_the_loop_started_checks_the_stop_first(engine):
    assert engine.loop._thread is None
    ran: list[int] = []
    with pytest.raises(Cancelled, match="before the task started"):
        engine.loop.run_task(lambda: ran.append(1), lambda: True)
    assert ran == [] and engine.loop.run_task(lambda: 7, lambda: False) == 7
