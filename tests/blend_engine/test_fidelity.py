"""Fidelity on real text: CacheBlend repairs most of what plain concatenation loses.

Ten MuSiQue dev questions from ../shared/data, all 20 paragraphs each as cached passages
(2-3K-token prompts), real default model, the engine's default selection policy.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.common.scoring import kl
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.types import BlendPlan, GenerationConfig, SelectionPolicy
from retrieval.text import format_passage
from tests.helpers import requires_shared_data, shared_data_file

DATA = shared_data_file("musique_dev.jsonl")
pytestmark = [pytest.mark.slow, requires_shared_data(DATA.name)]


@pytest.fixture(scope="module")
def engine(real_runner) -> BlendEngine:
    return BlendEngine(real_runner, MemoryStore(4 << 30, kv_format="fp16"), EngineConfig(kv_format="fp16"))


@pytest.fixture(scope="module")
def examples(engine) -> list[tuple[tuple[str, ...], str]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:10]]
    out = []
    for row in rows:
        passages = tuple(format_passage(p["paragraph_text"], p["title"]) for p in row["paragraphs"])
        for p in passages:
            engine.ensure_cached(p)
        out.append((passages, row["question"]))
    return out


def test_blend_repairs_most_of_full_reuses_divergence(engine, examples):
    assert len(examples) == 10 and all(len(p) >= 5 for p, _ in examples)
    unweighted = dataclasses.replace(SelectionPolicy(), query_weighted=False)
    reuse, b15, b30, plain15 = [], [], [], []
    for passages, question in examples:
        full = engine.prefill(BlendPlan(passages, question, mode="full_prefill")).logits
        reuse.append(kl(full, engine.prefill(BlendPlan(passages, question, mode="full_reuse")).logits))
        b15.append(kl(full, engine.prefill(BlendPlan(passages, question, recompute_ratio=0.15)).logits))
        b30.append(kl(full, engine.prefill(BlendPlan(passages, question, recompute_ratio=0.30)).logits))
        plain15.append(kl(full, engine.prefill(BlendPlan(passages, question, recompute_ratio=0.15, policy=unweighted)).logits))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(b15) <= 0.5 * mean(reuse), (mean(b15), mean(reuse))
    assert mean(b30) < mean(b15), (mean(b30), mean(b15))
    # the default weights deviation by the question's attention; that must beat deviation alone
    assert mean(b15) < mean(plain15), (mean(b15), mean(plain15))


def test_stored_passages_are_hits_and_only_a_fraction_is_recomputed(engine, examples):
    passages, question = examples[0]
    st = engine.prefill(BlendPlan(passages, question, recompute_ratio=0.15))
    assert st.report.cache_misses <= 1  # at most the system prefix, never a stored passage
    assert st.report.cache_hits >= len(passages)
    n_passage = sum(len(s.token_ids) for s in st.layout.segments if s.kind == "passage")
    sinks = sum(min(engine.config.policy.sink_tokens, len(s.token_ids)) for s in st.layout.segments if s.kind == "passage")
    last_layer = st.report.selected_per_layer[-1]
    assert last_layer <= (0.15 * n_passage + sinks + len(st.layout.segments[-1].token_ids)
                          + len(st.layout.segments[0].token_ids) + 1)


def test_greedy_answer_after_blend_at_ratio_one_equals_full_prefill(engine, examples):
    passages, question = examples[1]
    cfg = GenerationConfig(max_tokens=12)
    full = engine.run(BlendPlan(passages, question, mode="full_prefill"), cfg)
    blend = engine.run(BlendPlan(passages, question, recompute_ratio=1.0), cfg)
    assert full.text.strip()
    assert blend.token_ids == full.token_ids


def test_blend_at_ratio_one_matches_full_prefill_logits_on_the_real_model(real_runner, examples):
    exact = BlendEngine(real_runner, MemoryStore(1 << 30, kv_format="fp32"), EngineConfig(kv_format="fp32"))
    passages, question = examples[2][0][:6], examples[2][1]
    for p in passages:
        exact.ensure_cached(p)
    full = exact.prefill(BlendPlan(passages, question, mode="full_prefill")).logits
    blend = exact.prefill(BlendPlan(passages, question, recompute_ratio=1.0))
    assert blend.report.cache_hits >= len(passages)
    assert (blend.logits - full).abs().max().item() < 1e-3
