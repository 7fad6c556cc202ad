"""Issue #28's second round: EPIC's end boundary (`SelectionPolicy.end_tokens`) and APE's
reweighting of the question's attention to cached passages (`executor.ape`)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.common.policies import plain as plain_policy  # the old field defaults: one kv check
from blend_engine.executor.ape import ape_attend
from blend_engine.types import BlendPlan
from tests.blend_engine.test_engine import _cache_all, tiny_engine, tokenizer  # noqa: F401 - fixtures
from tests.helpers import PASSAGES, QUESTION

HQ, H, S, N = 4, 2, 3, 10
PASSAGE = torch.tensor([False, False, True, True, True, True, True, False, False, False])  # [N] keys 2..6


def _inputs(seed: int = 0, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(HQ, S, d, generator=g)  # [Hq, S, D]
    k = torch.randn(H, N, d, generator=g)  # [H, N, D]
    v = torch.randn(H, N, d, generator=g)  # [H, N, D]
    pos = torch.tensor([7, 8, 9])  # [S] the question's rows
    allowed = torch.arange(N)[None, :] <= pos[:, None]  # [S, N]
    return q, k, v, allowed


def test_ape_at_temperature_one_and_scale_one_is_plain_attention():
    q, k, v, allowed = _inputs()
    plain = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=allowed[None, None], scale=0.3, enable_gqa=True)  # [1, Hq, S, D]
    got = ape_attend(q, k, v, allowed, PASSAGE, 0.3, 1.0, 1.0)  # [S, Hq*D]
    assert torch.allclose(got, plain[0].transpose(0, 1).reshape(S, -1), atol=1e-5)


def test_ape_weights_are_the_merge_of_three_blocks_with_the_passages_cooled_and_scaled():
    """With V one-hot per key the output is the attention weights. APE's definition: the system,
    passage and question blocks merged by their log-sum-exp, the passages' taken at logits / T,
    times T, plus log S; within the passage block softmax(logits / T)."""
    q, k, _, allowed = _inputs(1)
    v = torch.eye(N).expand(H, N, N)  # [H, N, N]: key j writes e_j
    T, Sc, scale = 0.5, 0.7, 0.35
    got = ape_attend(q, k, v, allowed, PASSAGE, scale, T, Sc).reshape(S, HQ, N).transpose(0, 1)  # [Hq, S, N]
    logits = (q @ k.repeat_interleave(HQ // H, 0).transpose(1, 2)) * scale  # [Hq, S, N]
    logits = logits.masked_fill(~allowed, float("-inf"))
    blocks = {"sys": torch.arange(N) < 2, "doc": PASSAGE, "question": torch.arange(N) > 6}
    lse = {name: torch.logsumexp(logits[..., m], -1) for name, m in blocks.items()}  # [Hq, S] each
    lse["doc"] = torch.logsumexp(logits[..., PASSAGE] / T, -1) * T + math.log(Sc)
    mass = torch.softmax(torch.stack([lse["sys"], lse["doc"], lse["question"]], -1), -1)  # [Hq, S, 3]
    want = torch.zeros_like(got)
    for i, (name, m) in enumerate(blocks.items()):
        inner = torch.softmax(logits[..., m] / (T if name == "doc" else 1.0), -1)  # [Hq, S, |m|]
        want[..., m] = torch.nan_to_num(inner) * mass[..., i:i + 1]
    assert torch.allclose(got, want, atol=1e-5)
    plain = torch.softmax(logits, -1)  # [Hq, S, N]
    assert (got[..., PASSAGE].sum(-1) - plain[..., PASSAGE].sum(-1)).abs().max() > 1e-3  # it did reweight
    # the scale alone multiplies the passage block's odds
    only_s = ape_attend(q, k, v, allowed, PASSAGE, scale, 1.0, 2.0).reshape(S, HQ, N).transpose(0, 1)
    p0, p1 = plain[..., PASSAGE].sum(-1), only_s[..., PASSAGE].sum(-1)  # [Hq, S]
    assert torch.allclose(p1 / (1 - p1), 2 * p0 / (1 - p0), rtol=1e-4)


def test_ape_rows_that_see_no_passage_attend_plainly():
    q, k, v, _ = _inputs(2)
    allowed = torch.arange(N)[None, :] <= torch.tensor([0, 1, 1])[:, None]  # [S, N]: only the system keys
    plain = ape_attend(q, k, v, allowed, PASSAGE, 0.3, 1.0, 1.0)
    got = ape_attend(q, k, v, allowed, PASSAGE, 0.3, 0.5, 3.0)
    assert torch.isfinite(got).all() and torch.allclose(got, plain, atol=1e-6)


def test_ape_in_the_engine_changes_the_first_token_not_the_selection(tiny_engine):  # noqa: F811
    _cache_all(tiny_engine)
    base = plain_policy(check_layer=1, metric="k", schedule=((2, 1.0),))  # no question weighting: same picks
    ape = plain_policy(check_layer=1, metric="k", schedule=((2, 1.0),), ape_temperature=0.5, ape_scale=2.0)
    a = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.2, policy=base))
    b = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.2, policy=ape))
    assert a.report.recomputed_positions == b.report.recomputed_positions
    assert (a.logits - b.logits).abs().max() > 1e-4
    full = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill", policy=ape))  # not a blend: plain
    plain = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"))
    assert torch.equal(full.logits, plain.logits)


@pytest.mark.parametrize(("sinks", "ends"), [(2, 3), (0, 4)])
def test_epic_end_tokens_are_always_recomputed(tiny_engine, sinks, ends):  # noqa: F811
    for seg in tiny_engine.layout(BlendPlan(PASSAGES, QUESTION)).segments[:-1]:
        tiny_engine.cache_ids(seg.token_ids)  # the system prefix too: nothing but the boundaries and question left
    policy = plain_policy(use_deviation=False, sink_tokens=sinks, end_tokens=ends)
    st = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=policy))
    want = set()
    for seg in st.layout.segments:
        if seg.kind == "passage":
            want |= set(range(seg.offset, seg.offset + sinks)) | set(range(seg.end - ends, seg.end))
        elif seg.kind == "question":
            want |= set(range(seg.offset, seg.end))
    assert set(st.report.recomputed_positions) == want


def test_end_tokens_never_take_a_sink_twice(tiny_engine):  # noqa: F811
    from blend_engine.scheduler.plans import end_count

    seg = tiny_engine.layout(BlendPlan(PASSAGES, QUESTION)).segments[1]
    n = len(seg.token_ids)
    assert end_count(seg, 3, 4) == 4 and end_count(seg, n - 2, 4) == 2 and end_count(seg, n + 5, 4) == 0


def test_negative_boundaries_or_a_zero_temperature_are_refused():
    for bad in ({"end_tokens": -1}, {"sink_tokens": -2}, {"ape_temperature": 0.0}, {"ape_scale": -1.0}):
        with pytest.raises(ValueError):
            plain_policy(**bad)
