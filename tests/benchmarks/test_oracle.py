"""Issue #28's oracle seam (`benchmarks.quality.oracle_seam`, through `LayerHooks`): a blend whose selection is
given ("select"), a full reuse whose chosen positions take the full prefill's exact K/V ("fix"), and the
true-deviation ranking. Benchmarks only; serving runs the default hooks."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common.policies import plain as plain_policy  # the old field defaults: one kv check
from benchmarks.quality.oracle_seam import Oracle, top_positions, true_deviation
from blend_engine.executor.layers import KVCache
from blend_engine.types import BlendPlan
from tests.blend_engine.test_engine import _cache_all, tiny_engine, tokenizer  # noqa: F401 - fixtures
from tests.helpers import PASSAGES, QUESTION

POLICY = plain_policy(check_layer=1, metric="k", check_multiplier=4.0, schedule=((2, 1.0),))


def _cache_prompt(engine) -> None:
    """Every segment but the question cached, the system prefix too (else it is forced, uncached)."""
    _cache_all(engine)
    for seg in engine.layout(BlendPlan(PASSAGES, QUESTION)).segments:
        if seg.kind != "question":
            engine.cache_ids(seg.token_ids)


def _passage_positions(layout) -> torch.Tensor:
    return torch.tensor([p for s in layout.segments if s.kind == "passage" for p in range(s.offset, s.end)])


def _question_positions(layout) -> set[int]:
    q = layout.segments[-1]
    return set(range(q.offset, q.end))


def test_oracle_fix_of_every_passage_token_reproduces_full_prefill(tiny_engine):  # noqa: F811
    _cache_prompt(tiny_engine)
    full = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"), max_new_tokens=1)
    reuse = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_reuse"))
    every = _passage_positions(full.layout)
    fixed = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_reuse"),
                                hooks=Oracle("fix", every, full.cache))
    assert (reuse.logits - full.logits).abs().max().item() > 1e-2  # reuse alone is off: the test can fail
    assert (fixed.logits - full.logits).abs().max().item() < 1e-3
    assert fixed.report.recomputed_positions == reuse.report.recomputed_positions  # only the question recomputed
    # nothing chosen: plain full reuse
    none = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_reuse"),
                               hooks=Oracle("fix", every[:0], full.cache))
    assert torch.equal(none.logits, reuse.logits)
    # half of them: in between, and the chosen rows of the cache hold the exact values at every layer
    half = every[::2]
    part = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_reuse"), max_new_tokens=1,
                               hooks=Oracle("fix", half, full.cache))
    for layer in range(tiny_engine.runner.shape.n_layers):
        assert torch.equal(part.cache.k[layer][:, half], full.cache.k[layer][:, half])
        assert torch.equal(part.cache.v[layer][:, half], full.cache.v[layer][:, half])
        rest = every[1::2]
        assert torch.equal(part.cache.k[layer][:, rest], reuse.cache.k[layer][:, rest])


def test_oracle_select_keeps_exactly_the_given_set_at_every_layer_after_the_check(tiny_engine):  # noqa: F811
    _cache_prompt(tiny_engine)
    layout = tiny_engine.layout(BlendPlan(PASSAGES, QUESTION))
    chosen = _passage_positions(layout)[[0, 3, 4, 11, 20]]
    st = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=POLICY),
                             hooks=Oracle("select", chosen))
    want = sorted(set(chosen.tolist()) | _question_positions(layout))
    assert list(st.report.recomputed_positions) == want
    n = layout.n_tokens
    assert st.report.selected_per_layer[:2] == (n, len(want))  # all at layer 0; the set from the check layer on
    assert set(st.report.selected_per_layer[1:]) == {len(want)}  # never narrowed by the schedule
    plain = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=POLICY))
    assert list(plain.report.recomputed_positions) != want  # the oracle's set, not the policy's


def test_oracle_select_with_a_schedule_keeps_the_top_of_its_ranking_at_each_layer(tiny_engine):  # noqa: F811
    _cache_prompt(tiny_engine)
    layout = tiny_engine.layout(BlendPlan(PASSAGES, QUESTION))
    ranked = _passage_positions(layout).flip(0)[:12]  # rank order: the last passage tokens first
    question = _question_positions(layout)
    st = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=POLICY),
                             hooks=Oracle("select", ranked, schedule=((1, 12), (2, 5))))
    assert st.report.selected_per_layer == (layout.n_tokens, 12 + len(question), 5 + len(question),
                                            5 + len(question))
    assert list(st.report.recomputed_positions) == sorted(set(ranked[:5].tolist()) | question)
    with pytest.raises(ValueError, match="schedule"):
        Oracle("select", ranked, schedule=((1, 5), (2, 12)))  # counts may not grow
    with pytest.raises(ValueError, match="check layer"):
        tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=POLICY),
                            hooks=Oracle("select", ranked, schedule=((2, 5),)))


def test_oracle_select_of_every_passage_token_reproduces_full_prefill(tiny_engine):  # noqa: F811
    _cache_prompt(tiny_engine)
    full = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"))
    every = _passage_positions(full.layout)
    st = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=POLICY),
                             hooks=Oracle("select", every))
    assert (st.logits - full.logits).abs().max().item() < 1e-3


def test_oracle_select_takes_only_competing_positions(tiny_engine):  # noqa: F811
    _cache_prompt(tiny_engine)
    layout = tiny_engine.layout(BlendPlan(PASSAGES, QUESTION))
    for bad in (0, layout.segments[-1].offset):  # the system prefix, the question
        with pytest.raises(ValueError, match="competing"):
            tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=POLICY),
                                hooks=Oracle("select", torch.tensor([bad])))
    with pytest.raises(ValueError, match="check layer"):
        tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_reuse"),
                            hooks=Oracle("select", _passage_positions(layout)[:2]))
    with pytest.raises(ValueError, match="exact"):
        Oracle("fix", torch.tensor([1]))
    with pytest.raises(ValueError, match="mode"):
        Oracle("guess", torch.tensor([1]))


def _cache(values: list[list[float]], n: int = 3) -> KVCache:
    """A 1-head, 1-dim cache whose K at layer l, position p is values[l][p]; V zero."""
    c = KVCache(len(values), 1, n, 1, torch.float32, "cpu")
    for layer, row in enumerate(values):
        c.k[layer][0, :, 0] = torch.tensor(row)
        c.v[layer].zero_()
    return c


def test_true_deviation_weighs_every_layer_alike_and_leaves_layer_zero_out():
    exact = _cache([[0.0, 0.0, 0.0]] * 3)
    # layer 0: a huge deviation at position 0 (left out); layer 1: squared 0, 1, 8; layer 2: squared
    # 4e6, 0, 1e6: unnormalised layer 2 would pick position 0, with each layer over its mean it is 2
    blended = _cache([[1e6, 0.0, 0.0], [0.0, 1.0, 8 ** 0.5], [2000.0, 0.0, 1000.0]])
    pos = torch.arange(3)
    got = true_deviation(exact, blended, pos)  # [3]
    want = torch.tensor([0.0, 1.0, 8.0]) / 3 + torch.tensor([4e6, 0.0, 1e6]) / (5e6 / 3)
    assert torch.allclose(got, want)
    assert int(torch.argmax(got)) == 2
    with_zero = true_deviation(exact, blended, pos, first_layer=0)
    assert int(torch.argmax(with_zero)) == 0  # layer 0 would dominate position 0
    weighted = true_deviation(exact, blended, pos, weights=[torch.ones(3), torch.tensor([0.0, 0.0, 1.0]),
                                                              torch.tensor([0.0, 0.0, 1.0])])
    assert weighted[:2].abs().max() == 0 and weighted[2] > 0
    assert top_positions(torch.tensor([0.1, 5.0, 2.0, 3.0]), torch.tensor([10, 11, 12, 13]), 2).tolist() == [11, 13]
    with pytest.raises(ValueError):
        top_positions(torch.tensor([1.0]), torch.tensor([3]), 2)
