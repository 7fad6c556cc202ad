"""`ModelRunner.finish_layer` on the CPU: a long run of rows goes through o_proj and the MLP in equal
parts of at most `mlp_rows`, so that no MLP intermediate passes `MLP_PART_BYTES` (glibc maps a block
past its 32 MB ceiling afresh at every call, and every page of it faults in again)."""

from __future__ import annotations

import resource
from types import SimpleNamespace

import pytest
import torch

from blend_engine.model.runner import MLP_PART_BYTES, mlp_part_rows


def _rows(runner, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [n, E], attention output [n, Hq*D], random."""
    g = torch.Generator().manual_seed(seed)
    s = runner.shape
    return (torch.randn(n, s.hidden, generator=g), torch.randn(n, s.n_heads * s.head_dim, generator=g) * 0.1)


def _count_mlp_rows(runner, monkeypatch) -> list[int]:
    seen: list[int] = []
    mlp = runner._mlp
    monkeypatch.setattr(runner, "_mlp", lambda m, x: seen.append(x.shape[0]) or mlp(m, x))
    return seen


def test_a_long_run_of_rows_finishes_in_equal_parts_with_the_same_outputs(tiny_runner, monkeypatch):
    monkeypatch.setattr(tiny_runner, "mlp_rows", 16)
    hidden, attn = _rows(tiny_runner, 50)
    whole = tiny_runner._finish_rows(1, hidden, attn)  # [50, E], one call
    seen = _count_mlp_rows(tiny_runner, monkeypatch)
    with torch.no_grad():
        parts = tiny_runner.finish_layer(1, hidden, attn)  # [50, E]
    assert seen == [13, 13, 13, 11]  # ceil(50 / 16) = 4 parts of ceil(50 / 4) rows
    torch.testing.assert_close(parts, whole)


def test_short_runs_and_autograd_go_through_in_one_call(tiny_runner, monkeypatch):
    monkeypatch.setattr(tiny_runner, "mlp_rows", 16)
    seen = _count_mlp_rows(tiny_runner, monkeypatch)
    hidden, attn = _rows(tiny_runner, 16)
    with torch.no_grad():
        tiny_runner.finish_layer(0, hidden, attn)
    hidden, attn = _rows(tiny_runner, 40)
    hidden.requires_grad_(True)  # research runs differentiate through a layer (`benchmarks.quality.oracle`)
    tiny_runner.finish_layer(0, hidden, attn).sum().backward()
    assert seen == [16, 40]
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_a_part_holds_as_many_rows_as_the_bytes_allow(real_runner, tiny_runner):
    mlp = real_runner._layers[0].mlp
    inter = mlp.gate_proj.out_features
    rows = real_runner.mlp_rows
    assert real_runner.dtype == torch.float32
    assert rows * inter * 4 <= MLP_PART_BYTES < (rows + 1) * inter * 4  # SmolLM2: 1,365 rows of 1,536 floats
    assert mlp_part_rows(mlp, torch.float16, None) == MLP_PART_BYTES // (inter * 2)
    assert mlp_part_rows(mlp, torch.bfloat16, torch.float32) == rows  # the wider of the two dtypes counts
    huge = SimpleNamespace(gate_proj=SimpleNamespace(out_features=10**6))
    assert mlp_part_rows(huge, torch.float32, None) == 64  # never fewer rows than a product runs well on
    assert tiny_runner.mlp_rows == MLP_PART_BYTES // (tiny_runner._layers[0].mlp.gate_proj.out_features * 4)


def _faults_of_third_call(fn) -> int:
    """Minor page faults (this process) of fn's third call: the first two settle the allocator."""
    fn()
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_6k_prompts_layer_reuses_its_memory_instead_of_faulting_it_in_again(real_runner, monkeypatch):
    """The measured point of the parts: SmolLM2's MLP over 6,000 rows whole makes 37 MB intermediates,
    mapped and faulted in afresh (~9K pages apiece); in parts the same memory is used again."""
    hidden, attn = _rows(real_runner, 6000)
    with torch.inference_mode():
        in_parts = _faults_of_third_call(lambda: real_runner.finish_layer(0, hidden, attn))
        monkeypatch.setattr(real_runner, "mlp_rows", None)
        whole = _faults_of_third_call(lambda: real_runner.finish_layer(0, hidden, attn))
    # the control: intermediates of 6,000 x 1,536 floats (~9K pages each) mapped afresh at every call (three of
    # the four in the full suite, where one block was reused, all four alone)
    assert whole > 2 * 9000, whole
    assert in_parts < whole / 4, (in_parts, whole)


@pytest.mark.parametrize("n", [1, 7, 1365, 1366, 5839])
def test_parts_cover_every_row_once(tiny_runner, monkeypatch, n):
    monkeypatch.setattr(tiny_runner, "mlp_rows", 1365)
    seen = _count_mlp_rows(tiny_runner, monkeypatch)
    hidden, attn = _rows(tiny_runner, n)
    with torch.no_grad():
        out = tiny_runner.finish_layer(2, hidden, attn)
    assert out.shape == hidden.shape and sum(seen) == n and max(seen) <= 1365
    assert all(x == seen[0] for x in seen[:-1]) and seen[-1] <= seen[0]  # equal parts, the last no longer
