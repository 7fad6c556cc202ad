"""The CPU kernel of pooled decode attention (`executor.cpu_decode`) against dense SDPA, and the
rule that picks it. The kernel is built here (a C++ compiler is part of the CI image): a build
failure fails these tests rather than skipping them. test_models.py also runs it inside every model
family's decode step."""

from __future__ import annotations

import logging

import pytest
import torch

from blend_engine.executor import cpu_decode
from blend_engine.executor.decode import decode_attention, pooled_kernel
from tests.helpers import dense_decode_reference, ragged_pool, tiny_runner


@pytest.fixture(scope="module")
def kernel():
    assert cpu_decode.ensure(), cpu_decode.why_not()


def _case(lengths: list[int], h: int, grp: int, d: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    starts = [sum(lengths[:i]) + 7 * i for i in range(len(lengths))]  # runs apart, not at slot 0
    slots = starts[-1] + lengths[-1] + 5
    k = torch.randn(h, slots, d, generator=g)  # [H, slots, D]
    v = torch.randn(h, slots, d, generator=g)
    q = torch.randn(len(lengths), h, grp, d, generator=g)  # [B, H, G, D]
    n = torch.tensor(lengths)
    return q, k, v, torch.tensor(starts), n, n - 1


@pytest.mark.parametrize("window", [None, 1, 24])
@pytest.mark.parametrize(("h", "grp", "d"), [(2, 3, 16), (3, 3, 64), (1, 1, 24), (4, 2, 80)])
def test_the_kernel_equals_dense_attention_over_each_rows_slots(kernel, window, h, grp, d):
    """Ragged rows (one key, shorter than the window, past it), grouped and plain heads, head dims
    that are and are not a multiple of the vector width."""
    q, k, v, start, n, pos = _case([1, 5, 130, 77], h, grp, d)
    want = dense_decode_reference(q, k, v, start, n, pos, window, d ** -0.5)
    got = cpu_decode.paged_decode(q, k, v, start, n, pos, window, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_row_and_a_non_contiguous_query(kernel):
    q, k, v, start, n, pos = _case([300], 3, 3, 64)
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # [B, H, G, D] with another memory order
    want = dense_decode_reference(q, k, v, start, n, pos, None, 0.125)
    torch.testing.assert_close(cpu_decode.paged_decode(qt, k, v, start, n, pos, None, 0.125), want, rtol=1e-5, atol=1e-5)


def test_inputs_it_cannot_take_are_refused(kernel):
    q, k, v, start, n, pos = _case([5, 9], 2, 3, 16)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_decode.paged_decode(q.double(), k.double(), v.double(), start, n, pos, None, 0.25)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_decode.paged_decode(q, k, v, start + k.shape[1], n, pos, None, 0.25)
    with pytest.raises(RuntimeError, match="one value per row"):
        cpu_decode.paged_decode(q, k, v, start[:1], n, pos, None, 0.25)


def test_auto_reads_a_float32_pool_in_place_on_the_cpu(kernel):
    runner = tiny_runner()
    pool, runs, lengths = ragged_pool(runner)
    caches = [pool.view(run, m) for run, m in zip(runs, lengths)]
    cpu = torch.device("cpu")
    assert pooled_kernel(cpu) == "cpu" and pooled_kernel(cpu, torch.bfloat16) == "gather"
    assert decode_attention("auto", cpu, caches) == "pooled"
    assert decode_attention("per_sequence", cpu, caches) == "per_sequence"


def test_where_it_cannot_be_built_decode_says_why_and_attends_per_sequence(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**_kwargs):
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setattr(cpu_decode, "_state", {})  # not tried yet in this process (restored afterwards)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    runner = tiny_runner()
    pool, runs, lengths = ragged_pool(runner)
    caches = [pool.view(run, m) for run, m in zip(runs, lengths)]
    with caplog.at_level(logging.WARNING, logger=cpu_decode.__name__):
        assert decode_attention("auto", torch.device("cpu"), caches) == "per_sequence"
        assert pooled_kernel(torch.device("cpu")) == "gather"
    assert "c++: not found" in cpu_decode.why_not()
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1  # said once
    assert "unavailable" in caplog.records[0].getMessage()
