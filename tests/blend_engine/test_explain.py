"""Engine side of `explain`: per-token recompute flags, check-layer scores, cache status and tier."""

from __future__ import annotations

import math

import pytest

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.explain import token_pieces
from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.tiered import TieredStore
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig
from tests import helpers

PASSAGES = helpers.PASSAGES[:3]
QUESTION = helpers.QUESTION


@pytest.fixture(scope="module")
def runner(real_runner) -> ModelRunner:
    return helpers.tiny_runner(real_runner.tokenizer, name="tiny-explain", vocab_size=len(real_runner.tokenizer),
                               num_hidden_layers=6, max_position_embeddings=1024)


@pytest.fixture()
def engine(runner, tmp_path) -> BlendEngine:
    store = TieredStore([MemoryStore(1 << 28, kv_format="fp32"), DiskStore(tmp_path / "kv", 1 << 28, kv_format="fp32")])
    return BlendEngine(runner, store, EngineConfig(kv_format="fp32"))


def _warm(engine: BlendEngine, passages=PASSAGES) -> None:
    """Cache these passages and the system prefix (stored after a first answer)."""
    for p in passages:
        engine.ensure_cached(p)
    engine.run(BlendPlan(passages, QUESTION, mode="full_reuse"), GenerationConfig(max_tokens=1))


def _run(engine: BlendEngine, mode: str, explain: bool = True, ratio: float | None = 0.15, passages=PASSAGES):
    plan = BlendPlan(passages, QUESTION, mode=mode, recompute_ratio=ratio if mode == "blend" else None, explain=explain)
    return engine.run(plan, GenerationConfig(max_tokens=3))


def test_explain_is_off_by_default_and_changes_nothing(engine):
    _warm(engine)
    plain = _run(engine, "blend", explain=False)
    explained = _run(engine, "blend")
    assert plain.explanation is None
    assert explained.explanation is not None
    assert explained.token_ids == plain.token_ids
    assert explained.report.recomputed_positions == plain.report.recomputed_positions


@pytest.mark.parametrize("mode", ["blend", "full_prefill", "full_reuse", "prefix_cache"])
def test_recomputed_flags_add_up_to_the_report(engine, mode):
    _warm(engine, PASSAGES[:2])  # the third passage misses the cache
    result = _run(engine, mode)
    ex, report = result.explanation, result.report
    kinds = [s.kind for s in ex.segments]
    assert kinds == ["sys", "passage", "passage", "passage", "question"]
    assert ex.recomputed_tokens == report.recomputed_tokens
    flagged = [p for s, seg in zip(ex.segments, result_layout(engine)) for p, f in
               zip(range(seg.offset, seg.end), s.recomputed) if f]
    assert tuple(flagged) == report.recomputed_positions
    question = ex.segments[-1]
    assert all(question.recomputed) and question.cache == "off" and question.tier is None
    if mode == "full_prefill":
        assert all(all(s.recomputed) for s in ex.segments)
        assert {s.cache for s in ex.segments} == {"off"}
    elif mode != "prefix_cache":
        assert [s.cache for s in ex.segments[1:4]] == ["hit", "hit", "miss"]
        assert ex.segments[1].tier == "memory" and ex.segments[3].tier is None
        assert all(ex.segments[3].recomputed)  # a missed passage is recomputed whole


def result_layout(engine: BlendEngine):
    return engine.layout(BlendPlan(PASSAGES, QUESTION)).segments


def test_blend_scores_rank_the_cached_passage_tokens(engine):
    _warm(engine)
    ex = _run(engine, "blend", ratio=0.15).explanation
    assert ex.check_layer == engine.config.policy.check_layer and "deviation" in ex.metric
    passages = ex.segments[1:-1]
    scores = [s for seg in passages for s in seg.scores]
    assert all(s is not None and s >= 0 for s in scores)
    assert all(s is None for s in ex.segments[0].scores + ex.segments[-1].scores)
    # the final set is narrowed from the check layer's top ratio x check_multiplier: every recomputed
    # passage token ranked within that many at the check layer, except the EPIC sinks (always recomputed)
    flags = [f for seg in passages for f in seg.recomputed]
    assert 0 < sum(flags) < len(flags)
    sinks = engine.config.policy.sink_tokens
    assert all(all(seg.recomputed[:sinks]) for seg in passages)
    rest = [(s, f) for seg in passages for s, f in zip(seg.scores[sinks:], seg.recomputed[sinks:])]
    n_check = math.ceil(0.15 * engine.config.policy.check_multiplier * len(scores) - 1e-9)
    cutoff = sorted((s for s, _ in rest), reverse=True)[min(n_check, len(rest)) - 1]
    assert all(s >= cutoff for s, f in rest if f)


def test_tier_is_read_before_loading_promotes(engine):
    _warm(engine)
    memory = engine.store.tiers[0]
    key = engine.key_of(engine.passage_tokens(PASSAGES[1]))
    assert memory.delete(key)
    ex = _run(engine, "blend").explanation
    assert ex.segments[2].cache == "hit" and ex.segments[2].tier == "disk"
    assert ex.segments[1].tier == "memory"
    assert _run(engine, "blend").explanation.segments[2].tier == "memory"  # promoted by the first load


@pytest.mark.parametrize("text", ["Paris is the capital of France.\n\n", "Zürich — 東京 ☃ naïve  spaces\tand tabs"])
def test_token_pieces_join_to_the_text(runner, text):
    ids = runner.encode(text)
    pieces = token_pieces(runner.tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == runner.tokenizer.decode(ids)
