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
