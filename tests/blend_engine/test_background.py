"""The engine loop's background work (`blend_engine.loop.background`): stepped jobs advanced a unit a loop turn
on the loop's thread, never ahead of a request; the start-up fidelity gate run that way (issue #56 item 1:
no second thread on the model)."""

from __future__ import annotations

import threading
import time

import pytest

from blend_engine import selfcheck
from blend_engine.cancel import Cancelled
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.loop import background
from blend_engine.loop.background import Background
from blend_engine.types import BlendPlan, GenerationConfig
from tests.helpers import PASSAGES, QUESTION, poll

JOB_DEADLINE_S = 120.0  # a job that never saw the request end fails instead of spinning forever


@pytest.fixture
def engine(tiny_runner):
    eng = BlendEngine(tiny_runner, MemoryStore(1 << 28, kv_format="fp32"), EngineConfig(kv_format="fp32"))
    eng.loop.start()
    yield eng
    eng.close()


def test_a_stepped_job_runs_on_the_loop_thread_a_unit_a_turn_and_returns(engine):
    threads: list[str] = []

    def job():
        for _ in range(5):
            threads.append(threading.current_thread().name)
            yield
        return "done"

    assert engine.loop.run_stepped(job) == "done"
    assert threads == ["engine-loop"] * 5
    assert engine.loop.stats()["stepped_units"] == 5


def test_a_stepped_jobs_error_reaches_its_caller(engine):
    def job():
        yield
        raise ValueError("probe unreadable")

    with pytest.raises(ValueError, match="probe unreadable"):
        engine.loop.run_stepped(job)
    assert engine.run(BlendPlan(PASSAGES[:2], QUESTION), GenerationConfig(max_tokens=2)).token_ids  # loop alive


def test_a_request_is_answered_while_a_long_stepped_job_is_still_running(engine):
    """The job yields between units; the loop serves the request between them (and defers the job's
    units while the request's prefill waits), so the answer comes while the job still runs."""
    answered, units = threading.Event(), []

    def job():
        deadline = time.monotonic() + JOB_DEADLINE_S
        while not answered.is_set():
            units.append(1)
            if time.monotonic() > deadline:
                raise AssertionError("the request was not answered while the job ran")
            yield
        return len(units)

    result: dict = {}
    waiter = threading.Thread(target=lambda: result.setdefault("units", engine.loop.run_stepped(job)))
    waiter.start()
    try:
        assert poll(lambda: units)  # the job is running
        out = engine.run(BlendPlan(PASSAGES[:3], QUESTION), GenerationConfig(max_tokens=4, ignore_eos=True))
        answered.set()
        assert len(out.token_ids) == 4
    finally:
        answered.set()
        waiter.join(60)
    assert result["units"] >= 1


def test_closing_fails_a_queued_stepped_job(tiny_runner):
    cond = threading.Condition()
    thread = threading.Thread(target=lambda: None)  # "the loop": never advances anything
    bg = Background(cond, lambda: thread, lambda *a: 0)
    failed: list[BaseException] = []

    def caller():
        try:
            bg.run_stepped(lambda: iter(()))
        except Cancelled as exc:
            failed.append(exc)

    t = threading.Thread(target=caller)
    t.start()
    assert poll(lambda: bg.has_work)
    bg.close(Cancelled("shutting down"))
    t.join(10)
    assert failed and not bg.has_work
    with pytest.raises(Cancelled):
        bg.run_stepped(lambda: iter(()))


def test_the_fidelity_gate_runs_its_prefills_on_the_engine_loop_with_the_same_result(engine, tiny_runner, monkeypatch):
    config = EngineConfig(default_ratio=1.0, kv_format="fp32")
    threads: set[str] = set()
    real = BlendEngine.start_run

    def recording(self, *args, **kwargs):
        threads.add(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(BlendEngine, "start_run", recording)
    probe, long_probe = selfcheck.load_probe()[:2], selfcheck.load_long_probe()[:1]
    stepped = engine.loop.run_stepped(lambda: selfcheck.measure_steps(tiny_runner, config, probe, long_probe))
    assert threads == {"engine-loop"}
    threads.clear()
    direct = selfcheck.measure(tiny_runner, config, probe, long_probe)
    assert threads == {threading.current_thread().name}
    assert stepped.kl_full_reuse == pytest.approx(direct.kl_full_reuse, rel=1e-5, abs=1e-7)
    assert stepped.kl_blend_long == pytest.approx(direct.kl_blend_long, abs=1e-6) and stepped.passed == direct.passed


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _background(clock: _FakeClock, unit_s: float, passages: int = 4, layers: int = 10):
    """A Background over a fake stepped store whose every unit (a layer) takes `unit_s` on `clock`."""
    units: list[float] = []

    def store_steps(token_ids, salt):
        for layer in range(layers):
            if layer:
                yield
            clock.now += unit_s
            units.append(clock.now)
        return True

    class Layout:
        segments = [type("Seg", (), {"token_ids": (i,)})() for i in range(passages)]

    bg = Background(threading.Condition(), lambda: None, store_steps, clock=clock)
    bg.storing.add(Layout(), [f"k{i}" for i in range(passages)], range(passages), None)
    return bg, units


@pytest.mark.parametrize(("busy", "share"), [(False, background.SHARE), (True, background.BUSY_SHARE)])
def test_background_units_take_a_bounded_share_of_the_loop_while_requests_run(busy, share):
    """Issue #56: with requests in the batch, storing takes at most SHARE of the loop's time (BUSY_SHARE
    while a prefill waits), spread over the steps (no step waits for more than a unit beyond its
    credit), and it still progresses: never starved."""
    clock = _FakeClock()
    bg, units = _background(clock, unit_s=0.004, passages=100)  # more work than 200 steps allow
    step_s, spent = 0.02, []
    for _ in range(200):
        clock.now += step_s  # the batch's step
        before = clock.now
        bg.turn(step_s, busy=busy)
        spent.append(clock.now - before)
    total = 200 * step_s + sum(spent)
    assert units, "storing was starved"
    assert sum(spent) / total <= share + 0.004 / total + 1e-9
    assert sum(spent) / total >= share * 0.8
    assert max(spent) <= step_s * share / (1 - share) + 0.004 + 1e-9  # a turn's credit plus one unit's overrun


def test_with_no_request_background_units_run_for_a_slice():
    clock = _FakeClock()
    bg, units = _background(clock, unit_s=0.01)
    per_slice = round(background.IDLE_SLICE_S / 0.01)
    bg.turn(0.0, idle=True)
    first = len(units)
    assert per_slice <= first <= per_slice + 1  # units until the slice is spent (float rounding: one more)
    bg.turn(0.0, idle=True)
    assert per_slice <= len(units) - first <= per_slice + 1


def test_a_unit_longer_than_the_credit_is_paid_back_by_later_steps():
    """One unit may overrun a turn's credit (a layer cannot be cut); the debt keeps later turns free."""
    clock = _FakeClock()
    bg, units = _background(clock, unit_s=0.1)
    ran = []
    for _ in range(20):
        clock.now += 0.01
        n = len(units)
        bg.turn(0.01)
        ran.append(len(units) - n)
    assert ran[0] == 1 and sum(ran) == 1  # 20 steps of 10 ms earn 67 ms: the 100 ms unit's debt is not paid yet


def test_held_units_wait_for_host_work_then_resume():
    """Issue #56: while a query's host work is in flight (`hold`), no unit runs, idle or busy, and none
    is owed afterwards; once it is released the loop is woken and units run again."""
    clock = _FakeClock()
    bg, units = _background(clock, unit_s=0.01)
    bg.hold()
    bg.turn(0.0, idle=True)
    for _ in range(10):
        clock.now += 0.02
        bg.turn(0.02)
    assert units == [] and bg.held_turns == 11
    assert not bg.has_work and 0 < bg.wait_s() <= background.MAX_HOLD_S  # the loop sleeps, with a deadline
    bg.release()
    assert bg.has_work and bg.wait_s() is None
    clock.now += 0.02
    bg.turn(0.02)
    assert len(units) == 1  # one step's credit (SHARE of 20 ms) buys one 10 ms unit: nothing banked while held
    with pytest.raises(RuntimeError, match="without hold"):
        bg.release()


def test_a_hold_never_starves_storing():
    """Host work held without a break: units wait MAX_HOLD_S, then one turn's units run, and so on."""
    clock = _FakeClock()
    bg, units = _background(clock, unit_s=0.01, passages=100)
    bg.hold()
    ran_at = []
    while clock.now < 10 * background.MAX_HOLD_S:
        n = len(units)
        bg.turn(0.0, idle=True)
        if len(units) > n:
            ran_at.append(clock.now)
        clock.now += 0.01  # the loop slept until woken or timed out
    assert 9 <= len(ran_at) <= 11
    gaps = [b - a for a, b in zip(ran_at, ran_at[1:], strict=False)]
    assert all(background.MAX_HOLD_S - 0.02 <= g <= background.MAX_HOLD_S + 0.08 for g in gaps), gaps


def test_host_work_starting_during_a_slice_waits_for_one_unit_at_most():
    clock = _FakeClock()
    holds: list[int] = []

    def store_steps(token_ids, salt):
        for layer in range(10):
            if layer:
                yield
            clock.now += 0.01
            holds.append(layer)
            if len(holds) == 2:
                bg.hold()  # a query arrives while the idle slice runs
        return True

    class Layout:
        segments = [type("Seg", (), {"token_ids": (0,)})()]

    bg = Background(threading.Condition(), lambda: None, store_steps, clock=clock)
    bg.storing.add(Layout(), ["k0"], range(1), None)
    bg.turn(0.0, idle=True)
    assert len(holds) == 2  # the unit that was running finished; the slice stopped there
