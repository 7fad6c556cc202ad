"""The step's prefill budget from a time target (`scheduler.step_time`), fed measured steps."""

from __future__ import annotations

import pytest

from blend_engine.scheduler.batch import BatchLimits, BatchScheduler, SeqSpec
from blend_engine.scheduler.step_time import PROBE_UNITS, StepTime


def _learned(unit_s: float, decode_s: float = 0.020, steps: int = 30) -> StepTime:
    """A StepTime fed decode steps of `decode_s` and steps carrying 500 units at `unit_s` each."""
    st = StepTime(0.030)
    for _ in range(steps):
        st.decode_step(decode_s)
        st.prefill_step(decode_s + 500 * unit_s, 500)
    return st


def test_a_small_probe_budget_until_a_step_carrying_prefill_was_measured():
    """A fresh engine's first prefill beside a stream does not run at the token budget (an 86 ms step
    where the target gives ~45 ms): it probes with PROBE_UNITS and learns from that step."""
    st = StepTime(0.030)
    assert st.units(4096) == PROBE_UNITS and st.units(50) == 50
    st.prefill_step(0.100, 1000)  # no decode-only step yet: nothing to subtract, nothing learned
    assert st.units(4096) == PROBE_UNITS
    st.decode_step(0.020)
    st.prefill_step(0.100, 8)  # too little work to learn from
    assert st.units(4096) == PROBE_UNITS
    st.prefill_step(0.020 + PROBE_UNITS * 100e-6, PROBE_UNITS)  # the probe step, measured
    assert st.units(4096) == pytest.approx(300, abs=2)


def test_the_budget_is_what_the_target_buys_at_the_measured_cost():
    assert _learned(60e-6).units(4096) == pytest.approx(500, abs=2)  # 30 ms / 60 us
    assert _learned(10e-6).units(4096) == pytest.approx(3000, abs=2)
    assert _learned(1e-6).units(4096) == 4096  # the token budget caps it
    assert _learned(1.0).units(4096) == 1  # the oldest prefill still advances a layer a step


def test_the_cost_follows_the_machine():
    st = _learned(60e-6)
    for _ in range(40):  # the host got 4x slower at prefill work (another process took a core)
        st.decode_step(0.020)
        st.prefill_step(0.020 + 500 * 240e-6, 500)
    assert st.units(4096) == pytest.approx(125, abs=3)


def test_no_time_target_is_the_token_budget_alone():
    st = StepTime(None)
    st.decode_step(0.020)
    st.prefill_step(1.0, 1000)
    assert st.units(4096) == 4096
    with pytest.raises(ValueError):
        StepTime(0.0)
    with pytest.raises(ValueError):
        BatchLimits(prefill_step_s=-1.0)


def test_the_scheduler_hands_the_learned_budget_to_steps_while_others_decode():
    s = BatchScheduler(BatchLimits(max_batch=4, prefill_step_tokens=4096, block_tokens=4, prefill_step_s=0.030), 64, 1)
    s.add(SeqSpec(0, 10))
    assert s.schedule().prefill_tokens is None  # nothing decodes: the prefill runs whole
    s.prefilled(0)
    s.add(SeqSpec(1, 10))
    assert s.schedule().prefill_tokens == PROBE_UNITS  # nothing learned yet: a probe step
    for _ in range(20):
        s.step_time.decode_step(0.020)
        s.step_time.prefill_step(0.020 + 500 * 100e-6, 500)
    assert s.schedule().prefill_tokens == pytest.approx(300, abs=2)  # 30 ms at 100 us a unit
