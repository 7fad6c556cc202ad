"""Every row of a long prompt attends on SDPA's causal kernel where it was measured faster here than the C++
kernel (`ModelRunner.sdpa_causal_rows`, `runner.sdpa_causal_faster`); a blend's selected rows, sliding-window
layers and shorter prompts stay on the C++ kernel."""

from __future__ import annotations

import pytest
import torch

from blend_engine.executor.layers import LayerJob, run_layers
from blend_engine.model import cpu_kernels
from blend_engine.model.runner import CAUSAL_PROBE, sdpa_causal_faster


@pytest.fixture(scope="module")
def kernel():
    assert cpu_kernels.ensure(), cpu_kernels.why_not()


def _count_kernel_calls(monkeypatch) -> list[int]:
    """The row count of each `cpu_kernels.selected_attention` call from now on."""
    calls: list[int] = []
    own = cpu_kernels.selected_attention
    monkeypatch.setattr(cpu_kernels, "selected_attention",
                        lambda q, *a: calls.append(q.shape[1]) or own(q, *a))
    return calls


def test_the_probe_times_the_kernel_then_sdpa_at_the_runners_heads(kernel, tiny_runner):
    timed: list[torch.Tensor] = []

    def timer(times):
        def run(fn):
            timed.append(fn())  # [T, Hq*D]
            return times[len(timed) - 1]
        return run

    assert sdpa_causal_faster(tiny_runner, 40, timer([2.0, 1.0])) is True
    assert timed[0].shape == (40, tiny_runner.shape.n_heads * tiny_runner.shape.head_dim)
    torch.testing.assert_close(timed[1], timed[0])  # the same attention, both ways
    timed.clear()
    assert sdpa_causal_faster(tiny_runner, 40, timer([1.0, 2.0])) is False


def test_tiny_runners_keep_the_kernel_and_real_ones_measure(kernel, tiny_runner, real_runner):
    assert tiny_runner.sdpa_causal_rows is None  # too small to time: tests keep the kernel's path
    assert real_runner.sdpa_causal_rows in (None, CAUSAL_PROBE)


def test_from_its_rows_a_prefill_attends_on_sdpa_with_the_same_outputs(kernel, tiny_runner, monkeypatch):
    ids = torch.tensor(tiny_runner.encode("The quick brown fox jumps over the lazy dog. " * 4))  # [N]
    assert tiny_runner.windows[0] is None and len(ids) > 20
    calls = _count_kernel_calls(monkeypatch)
    with torch.inference_mode():
        own = run_layers(tiny_runner, LayerJob(ids))
        kernel_calls = len(calls)
        monkeypatch.setattr(tiny_runner, "sdpa_causal_rows", 20)
        sdpa = run_layers(tiny_runner, LayerJob(ids))
    assert kernel_calls == tiny_runner.shape.n_layers - 1  # every layer but the last (its one row: SDPA)
    assert len(calls) == kernel_calls  # none more: every all-row layer went to SDPA
    torch.testing.assert_close(sdpa.last_hidden, own.last_hidden, rtol=1e-4, atol=1e-5)
    N = len(ids)
    torch.testing.assert_close(sdpa.cache.k[2][:, :N], own.cache.k[2][:, :N], rtol=1e-4, atol=1e-5)


def test_short_prompts_and_sliding_windows_stay_on_the_kernel(kernel, tiny_runner, monkeypatch):
    monkeypatch.setattr(tiny_runner, "sdpa_causal_rows", 20)
    assert tiny_runner.causal_on_sdpa(0, 20) and not tiny_runner.causal_on_sdpa(0, 19)
    monkeypatch.setattr(tiny_runner, "windows", [24] * tiny_runner.shape.n_layers)
    assert not tiny_runner.causal_on_sdpa(0, 4000)
    monkeypatch.setattr(tiny_runner, "sdpa_causal_rows", None)
    monkeypatch.setattr(tiny_runner, "windows", [None] * tiny_runner.shape.n_layers)
    assert not tiny_runner.causal_on_sdpa(0, 4000)
