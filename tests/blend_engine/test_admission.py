"""The one admission point (`scheduler.admission`): its rules as plain numbers, and the engine loop
deciding with them: a full queue and work that would outlast its deadline are refused at submit, a
queued request whose time left is too short is dropped unstarted, a full batch makes the next wait;
every decision is counted by its reason and nothing is left behind. Time is a fake clock (the
loop's `clock` seam); the loop is held busy by a task, never by a sleep."""

from __future__ import annotations

import threading

import pytest

from blend_engine.cancel import DeadlineExceeded
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.errors import Overloaded
from blend_engine.generation import Ended
from blend_engine.kv_store import MemoryStore
from blend_engine.scheduler import admission as rules
from blend_engine.scheduler.admission import AdmissionControl, AdmissionLimits
from blend_engine.scheduler.batch import BatchLimits
from blend_engine.types import BlendPlan, GenerationConfig, Mode
from tests.helpers import held_loop

GEN = GenerationConfig(max_tokens=3, ignore_eos=True)
PLAN = BlendPlan(("The Arno flows past old mills.",), "Which river?", mode=Mode.FULL_PREFILL)


def test_the_rules_as_numbers():
    assert rules.queue_full(2, 2) and not rules.queue_full(1, 2) and not rules.queue_full(10**6, None)
    assert not rules.queue_full(2, 2, free_places=1) and rules.queue_full(3, 2, free_places=1)
    assert (rules.free_places(3, 4), rules.free_places(5, 4), rules.free_places(5, None)) == (1, 0, 0)
    assert rules.expected_wait_s(0.3, waiting=1, running=1, parallel=2) == pytest.approx(0.6)
    assert rules.expected_wait_s(0.3, waiting=1, running=1, parallel=1) == pytest.approx(0.9)
    assert not rules.too_slow(0.3, 0, 0, 1, timeout_s=0.1)  # nothing ahead: never refused on estimates
    assert not rules.too_slow(0.3, 1, 0, 1, timeout_s=0.7) and rules.too_slow(0.3, 2, 0, 1, timeout_s=0.8)
    assert not rules.too_slow(None, 5, 5, 1, timeout_s=0.1)  # nothing measured yet
    assert not rules.too_slow(2.0, 5, 5, 1, timeout_s=1.0)  # such requests usually outlast it anyway
    assert rules.too_late(0.3, time_left_s=0.2, timeout_s=1.0) and not rules.too_late(0.3, 0.4, 1.0)
    assert not rules.too_late(0.3, 0.2, None)
    assert rules.batch_has_room(1, 2) and not rules.batch_has_room(2, 2)


class _Sink:
    """One request's items from the loop; `ended` is set by its result or its error."""

    def __init__(self) -> None:
        self.items: list[object] = []
        self.ended = threading.Event()

    def __call__(self, index: int, item: object) -> None:
        self.items.append(item)
        if isinstance(item, (Ended, BaseException)):
            self.ended.set()

    @property
    def outcome(self) -> object:
        assert self.ended.wait(30)
        return self.items[-1]


def _engine(runner, max_queue: int | None = None, max_batch: int = 1) -> BlendEngine:
    limits = BatchLimits(max_batch=max_batch, kv_budget_bytes=64 << 20, block_tokens=16, max_queue=max_queue)
    eng = BlendEngine(runner, MemoryStore(1 << 26), EngineConfig(batch=limits))
    assert isinstance(eng.run(PLAN, GEN).token_ids, tuple)  # the loop thread runs from here on
    return eng


def _submit(eng: BlendEngine, timeout_s: float | None = None) -> _Sink:
    sink = _Sink()
    eng.start(PLAN, [GEN], sink, timeout_s=timeout_s)
    return sink


def _drained(eng: BlendEngine) -> None:
    a, st = eng.loop.admission, eng.loop.stats()
    assert (a.queued, a.running, a.places, st["running"], st["waiting"], st["kv_blocks_in_use"]) == (0,) * 6


def test_a_request_holds_a_batch_place_for_each_of_its_sequences():
    """The queue's bound counts free places in sequences, as the batch does: a running request of n = 3
    in a batch of 4 leaves one place (counting requests, three), and gives all three back when it ends."""
    a = AdmissionControl(AdmissionLimits(max_queue=1, max_batch=4))
    a.admit(None).use()
    a.started(places=3)
    a.admit(None)  # takes the free place at the next step
    a.admit(None)  # waits beyond the batch: the queue of one
    with pytest.raises(Overloaded, match="queue is full"):
        a.admit(None)  # (counting requests, three places free: admitted)
    a.finished(0.2, places=3)
    a.admit(None)  # four places free again
    assert (a.queued, a.running, a.places) == (3, 0, 0)


def test_the_loop_counts_a_requests_sequences_as_its_places(tiny_runner):
    eng = _engine(tiny_runner, max_batch=4)
    try:
        ended: list[object] = []
        all_ended = threading.Event()

        def sink(index: int, item: object) -> None:
            if isinstance(item, (Ended, BaseException)):
                ended.append(item)
                if len(ended) == 3:
                    all_ended.set()

        with held_loop(eng.loop):
            eng.start(PLAN, [GEN] * 3, sink)
            assert eng.loop.admission.queued == 1  # one request, not three
        assert all_ended.wait(30) and all(isinstance(e, Ended) for e in ended)
        _drained(eng)  # its three places given back
        assert eng.loop.admission.decisions["admitted"] == 2  # the warm-up and the request of n = 3
    finally:
        eng.close()


def test_a_full_queue_is_refused_at_submit_and_a_full_batch_waits(tiny_runner):
    """The queue's bound counts the requests waiting beyond the batch's free places: with the
    batch of one empty, the first queued request takes that place at the next step."""
    eng = _engine(tiny_runner, max_queue=2, max_batch=1)
    try:
        with held_loop(eng.loop):
            sinks = [_submit(eng) for _ in range(3)]  # one for the free place, two waiting beyond it
            assert eng.loop.admission.queued == 3
            with pytest.raises(Overloaded, match="queue is full") as refused:
                _submit(eng)
            assert refused.value.reason == "refused_queue_full"
        assert all(isinstance(s.outcome, Ended) for s in sinks)
        d = eng.loop.admission.decisions
        assert (d["admitted"], d["refused_queue_full"]) == (4, 1)  # the warm-up and the three
        assert d["waited_batch_full"] == 2  # the second and third, behind the first: each counted once
        _drained(eng)
    finally:
        eng.close()


def test_a_request_ended_frees_its_place_for_the_next_before_the_queue_moves(tiny_runner):
    """A full batch and a full queue: one running request ends, and a client asking again at once
    (before the loop's next step admits the queue's head) is queued, not refused."""
    control = AdmissionControl(AdmissionLimits(max_queue=1, max_batch=1))
    control.admit(None).use()
    control.started()  # the batch of one is full
    control.admit(None).use()  # the queue of one is full
    with pytest.raises(Overloaded, match="queue is full"):
        control.admit(None)
    control.finished(0.1)  # the running one ended; the queue's head starts only at the next step
    control.admit(None).use()
    assert (control.queued, control.running) == (2, 0)
    with pytest.raises(Overloaded, match="queue is full"):
        control.admit(None)


def test_work_past_its_deadline_is_refused_or_dropped_unstarted(tiny_runner):
    eng = _engine(tiny_runner, max_batch=1)
    now = [100.0]
    eng.loop.clock = lambda: now[0]
    eng.loop.admission = AdmissionControl(AdmissionLimits(None), took_s=0.3)  # a request costs 0.3 s
    try:
        with held_loop(eng.loop):
            doomed = _submit(eng, timeout_s=0.7)  # nothing ahead: ~0.3 s, fits
            with pytest.raises(Overloaded, match="longer than the request's") as refused:
                _submit(eng, timeout_s=0.5)  # one ahead: ~0.6 s, does not
            assert refused.value.reason == "refused_too_slow"
            patient = _submit(eng, timeout_s=5.0)
            now[0] += 0.5  # doomed has 0.2 s left, less than a request takes
        assert isinstance(doomed.outcome, DeadlineExceeded) and "could not finish" in str(doomed.outcome)
        assert not any(isinstance(i, Ended) for i in doomed.items)
        assert isinstance(patient.outcome, Ended)
        d = eng.loop.admission.decisions
        assert (d["refused_too_slow"], d["dropped_too_late"], d["admitted"]) == (1, 1, 1)
        _drained(eng)
        with held_loop(eng.loop):
            late = _submit(eng, timeout_s=1.0)
            now[0] += 2.0  # past its deadline while queued
        assert isinstance(late.outcome, DeadlineExceeded)
        _drained(eng)
    finally:
        eng.close()


def test_a_request_of_n_sequences_is_admitted_and_ended_once(tiny_runner):
    eng = _engine(tiny_runner, max_queue=1, max_batch=4)
    try:
        sinks = [_Sink() for _ in range(3)]
        eng.start(PLAN, [GEN] * 3, lambda i, item: sinks[i](i, item))
        assert all(isinstance(s.outcome, Ended) for s in sinks)
        d = eng.loop.admission.decisions
        assert d["admitted"] == 2  # the warm-up, and the three sequences as one request
        _drained(eng)
    finally:
        eng.close()


def test_a_request_costs_its_share_of_the_loop_not_its_wall_time(tiny_runner):
    """Three requests batched together each cost about a third of the steps they shared: admission
    learns the batch's real speed instead of taking a loaded request's wall time as its own work."""
    eng = _engine(tiny_runner, max_batch=4)
    eng.loop.admission = AdmissionControl(AdmissionLimits(None))  # nothing learned yet
    try:
        with held_loop(eng.loop):
            sinks = [_Submitted(eng) for _ in range(3)]
        walls = [s.outcome.result.total_ms / 1e3 for s in sinks]
        assert eng.loop.admission.took_s < 0.6 * max(walls), (eng.loop.admission.took_s, walls)
        _drained(eng)
    finally:
        eng.close()


class _Submitted(_Sink):
    def __init__(self, eng: BlendEngine) -> None:
        super().__init__()
        eng.start(PLAN, [GenerationConfig(max_tokens=24, ignore_eos=True)], self)
