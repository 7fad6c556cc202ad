"""Per-passage recompute budgets (`SelectionPolicy.allocation`, `selection.shared_out`)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common.policies import plain as plain_policy  # the old field defaults: one kv check
from blend_engine.executor.selection import shared_out
from blend_engine.types import BlendPlan
from tests.blend_engine.test_engine import _cache_all, tiny_engine, tokenizer  # noqa: F401 - fixtures
from tests.helpers import PASSAGES, QUESTION


def _kept(score, competing, pid, quota, k):
    return set(torch.topk(shared_out(score, competing, pid, quota), k).indices.tolist())


def test_equal_shares_take_the_best_of_each_passage_even_when_one_passage_scores_higher():
    score = torch.tensor([9.0, 8.0, 7.0, 6.0, 0.4, 0.3, 0.2, 0.1])  # passage 0 outranks passage 1 everywhere
    pid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    competing = torch.ones(8, dtype=torch.bool)
    assert set(torch.topk(score, 4).indices.tolist()) == {0, 1, 2, 3}  # one global top-k: all from passage 0
    assert _kept(score, competing, pid, torch.tensor([1.0, 1.0]), 4) == {0, 1, 4, 5}


def test_shares_follow_the_quota_and_order_within_a_passage_is_by_score():
    score = torch.tensor([1.0, 5.0, 3.0, 2.0, 4.0, 6.0, 0.5, 0.7])
    pid = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    competing = torch.ones(8, dtype=torch.bool)
    assert _kept(score, competing, pid, torch.tensor([6.0, 2.0]), 4) == {5, 1, 4, 7}  # 3 of passage 0, 1 of 1


def test_a_passage_short_of_candidates_hands_its_share_to_the_others():
    score = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 9.0])
    pid = torch.tensor([0, 0, 0, 0, 0, 1])
    competing = torch.ones(6, dtype=torch.bool)
    kept = _kept(score, competing, pid, torch.tensor([1.0, 1.0]), 4)  # passage 1's share is 2, it has 1
    assert kept == {5, 4, 3, 2}


def test_rows_that_do_not_compete_get_minus_inf_whatever_their_score():
    score = torch.tensor([float("nan"), 3.0, float("inf"), 1.0])
    competing = torch.tensor([False, True, False, True])
    out = shared_out(score, competing, torch.tensor([0, 0, 2, 1]), torch.tensor([1.0, 1.0]))
    assert out[0] == float("-inf") and out[2] == float("-inf")
    assert torch.isfinite(out[[1, 3]]).all()


def test_unknown_allocation_or_query_mass_is_refused():
    with pytest.raises(ValueError, match="allocation"):
        plain_policy(allocation="even")
    with pytest.raises(ValueError, match="query_mass"):
        plain_policy(query_mass="all")


@pytest.mark.parametrize("allocation", ["length", "attention"])
def test_engine_keeps_the_global_budget_and_by_length_each_passage_its_share(tiny_engine, allocation):  # noqa: F811
    _cache_all(tiny_engine)
    ratio = 0.3
    policy = plain_policy(check_layer=1, metric="k", query_weighted=True, allocation=allocation)
    plain = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=ratio,
                                          policy=plain_policy(check_layer=1, metric="k", query_weighted=True)))
    st = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=ratio, policy=policy))
    assert st.report.selected_per_layer == plain.report.selected_per_layer  # same cost as one global top-k
    chosen = set(st.report.recomputed_positions)
    question = st.layout.segments[-1]
    assert set(range(question.offset, question.end)) <= chosen
    if allocation == "length":
        for seg in st.layout.segments:
            if seg.kind == "passage":
                got = sum(seg.offset <= p < seg.end for p in chosen)
                assert abs(got - ratio * len(seg.token_ids)) <= 1.5, (seg.offset, got, len(seg.token_ids))


def test_running_query_mass_is_the_mean_over_the_selecting_layers(tiny_engine):  # noqa: F811
    from blend_engine.executor.selection import RankSpace

    layout = tiny_engine.layout(BlendPlan(PASSAGES, QUESTION))
    cached = [s for s in layout.segments if s.kind != "question"]
    rank = RankSpace(layout, cached, tiny_engine.runner.scaling)
    n, shape = layout.n_tokens, tiny_engine.runner.shape
    torch.manual_seed(3)
    q1, q2 = torch.randn(2, shape.n_heads, n, shape.head_dim)  # [Hq, N, D] each
    k1, k2 = torch.randn(2, shape.n_kv_heads, n, shape.head_dim)  # [H, N, D] each
    K = torch.zeros_like(k1)
    m1, m2 = rank._attention_mass(q1, k1, K, None), rank._attention_mass(q2, k2, K, None)  # [N] each
    assert torch.allclose(rank._question_mass(q1, k1, K, None, "running"), m1)
    assert torch.allclose(rank._question_mass(q2, k2, K, None, "running"), (m1 + m2) / 2)
    assert torch.allclose(rank._question_mass(q2, k2, K, None, "layer"), m2)
    assert not torch.allclose(m1, m2)
