"""The engine benchmark's length sweep (`benchmarks.quality.lengths`) on a tiny model: references cached
per question, variants scored against them, the worst cell per variant."""

from __future__ import annotations

import pytest

from benchmarks.common.data import Example, Paragraph
from benchmarks.common.policies import plain as plain_policy  # the old field defaults: one kv check
from benchmarks.quality import lengths
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore

WORDS = "the river flows past an old mill where a miller ground grain for the village every autumn".split()


def _example(i: int) -> Example:
    paras = tuple(Paragraph(f"Title {i}.{j}", " ".join(WORDS[(i + j) % 5:] + WORDS[:(i + j) % 5]), j == 1)
                  for j in range(4))
    return Example("toy", f"q{i}", f"Where did the miller {i} grind grain?", ("the mill",), paras)


def test_ratio_grows_with_passage_length_within_its_cap():
    v = lengths.Variant(0.15, grow_ref=100.0, grow_power=0.5, grow_cap=4.0)
    assert v.ratio_for([50, 80]) == 0.15
    assert v.ratio_for([400]) == pytest.approx(0.30)
    assert v.ratio_for([10_000]) == pytest.approx(0.30)  # capped at 4x the tokens: 2x the ratio
    assert lengths.Variant(0.15).ratio_for([10_000]) == 0.15
    sinks = lengths.Variant(0.15, plain_policy(sink_tokens=8), sinks_in_budget=True)
    assert sinks.ratio_for([100, 100]) * (200 - 16) + 16 == pytest.approx(0.15 * 200)  # same total recomputed
    both = lengths.Variant(0.15, plain_policy(sink_tokens=4, end_tokens=4), sinks_in_budget=True)
    assert both.ratio_for([100, 100]) * (200 - 16) + 16 == pytest.approx(0.15 * 200)  # ends come out of it too


SWEEP_CONFIG = EngineConfig(kv_format="fp32", prefix_caching=False)  # each variant computes its own prompt


def test_sweep_scores_variants_against_cached_references(tiny_runner, tmp_path, monkeypatch):
    engine = BlendEngine(tiny_runner, MemoryStore(1 << 28, kv_format="fp32"), SWEEP_CONFIG)
    rows = {"toy": [_example(0), _example(1)]}
    variants = {"exact": lengths.Variant(1.0), "default": lengths.Variant(0.15)}
    cells = lengths.sweep(engine, "tiny", rows, [0, 40], variants, tmp_path / "c.json", answers=True)
    assert [(c.dataset, c.group_words) for c in cells] == [("toy", 0), ("toy", 40)]
    summaries = [lengths.summarize(c) for c in cells]
    one, grouped = summaries
    assert one["passages"] == 4 and grouped["passages"] < 4  # ~40-word groups of ~16-word paragraphs
    for s in summaries:
        exact = s["variants"]["exact"]
        assert exact["kl"] < 1e-6 and exact["top1"] == 1.0 and exact["f1_vs_full"] == 1.0
        assert s["full_reuse_kl"] > 0 and s["reordered_top1"] is not None
        assert s["variants"]["default"]["recomputed"] < exact["recomputed"]  # (the system prefix is never recomputed)
    worst = lengths.worst_case(summaries)
    assert worst["exact"]["kl_ratio"] < 1e-4 and worst["exact"]["top1_margin"] >= 0
    assert worst["default"]["kl_ratio"] == max(s["variants"]["default"]["kl_ratio"] for s in summaries)

    def no_prefill(*_a, **_k):
        raise AssertionError("recomputed a cached reference or result")

    monkeypatch.setattr(engine, "prefill", no_prefill)
    monkeypatch.setattr(engine, "generate", no_prefill)
    again = lengths.sweep(engine, "tiny", rows, [0, 40], variants, tmp_path / "c.json")
    assert [lengths.summarize(c) for c in again] == summaries
    cached = lengths.sweep(None, "tiny", rows, [0, 40], variants, tmp_path / "c.json")  # no engine: the cache alone
    assert [lengths.summarize(c) for c in cached] == summaries
    more = rows | {"toy": rows["toy"] + [_example(2)]}  # a question never run: left out, its n says so
    partial = lengths.sweep(None, "tiny", more, [0, 40], variants, tmp_path / "c.json")
    assert [lengths.summarize(c) for c in partial] == summaries
    extra = variants | {"never run": lengths.Variant(0.5)}  # a variant never run: no question has all of them
    assert lengths.sweep(None, "tiny", rows, [0, 40], extra, tmp_path / "c.json") == []
    first_token = lengths.sweep(None, "tiny", rows, [0], {"exact": variants["exact"]}, tmp_path / "c.json", answers=False)
    assert first_token[0].runs["exact"][0]["kl"] < 1e-6 and len(first_token[0].refs) == 2


def test_two_runs_sharing_a_cache_file_keep_each_others_results(tmp_path):
    import torch

    a, b = lengths.RefCache(tmp_path / "c.json"), lengths.RefCache(tmp_path / "c.json")
    a.data["q1"] = {"ref": {"answer": "x"}, "runs": {"v1": {"kl": 0.1}}}
    a.logits["q1"] = torch.zeros(3)
    a.save()
    b.data["q1"] = {"ref": {"answer": "x", "reordered_top1": 1.0}, "runs": {"v2": {"kl": 0.2}}}
    b.data["q2"] = {"ref": {"answer": "y"}, "runs": {}}
    b.logits["q2"] = torch.ones(3)
    b.save()  # b never saw a's v1: the save merges instead of overwriting
    merged = lengths.RefCache(tmp_path / "c.json")
    assert set(merged.data) == {"q1", "q2"} and set(merged.data["q1"]["runs"]) == {"v1", "v2"}
    assert merged.data["q1"]["ref"]["reordered_top1"] == 1.0 and set(merged.logits) == {"q1", "q2"}


def test_oracle_variants_in_the_sweep(tiny_runner, tmp_path, monkeypatch):
    """Issue #28's oracle bound: at ratio 1 both oracles are full prefill; at 0.15 the oracle
    selection recomputes as many tokens as the default keeps in the end; refs are computed once a
    question, and not at all when no oracle runs."""
    from benchmarks.quality import oracle

    engine = BlendEngine(tiny_runner, MemoryStore(1 << 28, kv_format="fp32"), SWEEP_CONFIG)
    rows = {"toy": [_example(0), _example(1)]}
    # the default's shape (check at layer 1, 4x, narrowed) narrowed to 1x within the tiny model's 4 layers
    blend = plain_policy(check_layer=1, metric="k", check_multiplier=4.0, schedule=((2, 1.0),), query_weighted=True)
    variants = {"default": lengths.Variant(0.15, blend),
                "select@1": lengths.Variant(1.0, oracle="select"), "fix@1": lengths.Variant(1.0, oracle="fix"),
                "select@0.15": lengths.Variant(0.15, oracle="select"), "fix@0.15": lengths.Variant(0.15, oracle="fix"),
                "select qa@0.15": lengths.Variant(0.15, oracle="select", oracle_rank="qa"),
                "sched@0.15": lengths.Variant(0.15, oracle="select-sched")}
    built = []
    real = oracle.oracle_refs
    monkeypatch.setattr(oracle, "oracle_refs", lambda *a: built.append(1) or real(*a))
    cells = lengths.sweep(engine, "tiny", rows, [0], variants, tmp_path / "c.json", answers=True)
    assert len(built) == 2  # once per question, shared by its oracle variants
    s = lengths.summarize(cells[0])["variants"]
    assert s["select@1"]["kl"] < 1e-6 and s["fix@1"]["kl"] < 1e-6 and s["fix@1"]["top1"] == 1.0
    assert s["select@0.15"]["recomputed"] == pytest.approx(s["default"]["recomputed"])  # the same count
    assert s["fix@0.15"]["recomputed"] == pytest.approx(s["default"]["recomputed"])  # corrected, not recomputed
    # the default's narrowing (4x > 2x > 1.5x > 1x by layer 4) stops at 1.5x in the 4-layer model
    assert s["sched@0.15"]["recomputed"] > s["select@0.15"]["recomputed"]
    assert s["select@0.15"]["f1_vs_full"] is None  # first token only
    run = cells[0].runs["default"][0]
    assert run["full_rank_of_top1"] == 0 if run["top1"] else run["full_rank_of_top1"] > 0
    # only non-oracle variants: no oracle references computed
    lengths.sweep(engine, "tiny", {"toy": [_example(2)]}, [0], {"default": variants["default"]}, tmp_path / "c.json")
    assert len(built) == 2
    # the cache alone serves the oracle variants too
    cached = lengths.sweep(None, "tiny", rows, [0], variants, tmp_path / "c.json")
    assert [lengths.summarize(c) for c in cached] == [lengths.summarize(c) for c in cells]


def test_question_mass_pass_is_full_prefills_question(tiny_runner):
    from benchmarks.quality import oracle
    from blend_engine.types import BlendPlan

    engine = BlendEngine(tiny_runner, MemoryStore(1 << 28, kv_format="fp32"), SWEEP_CONFIG)
    ex = _example(0)
    plan = BlendPlan(tuple(p.text for p in ex.paragraphs), ex.question)
    lengths.cache_segments(engine, plan)  # the system prefix too: the oracle ranks cached passages only
    full = engine.prefill(BlendPlan(plan.passages, plan.question, mode="full_prefill"), max_new_tokens=1)
    refs = oracle.oracle_refs(engine, plan)
    assert (refs.question_logits - full.logits).abs().max().item() < 1e-3
    masses, _ = oracle.question_mass(engine.runner, full.cache, full.layout)
    heads, q = tiny_runner.shape.n_heads, len(full.layout.segments[-1].token_ids)
    assert all(m.sum().item() == pytest.approx(heads * q, rel=1e-4) for m in masses)  # softmax rows sum to 1
    assert refs.scores["deviation"].shape == refs.compete.shape and (refs.scores["deviation"] >= 0).all()


def test_explain_misses_lists_disagreements_from_the_cache(tmp_path):
    import torch

    rows = {"toy": [_example(0), _example(1)]}
    v = lengths.Variant(0.15)
    cache = lengths.RefCache(tmp_path / "c_toy.json")
    full = torch.tensor([3.0, 2.5, 0.0, -1.0])  # full prefill: token 0, token 1 a close second
    miss = lengths.top1_detail(full, torch.tensor([0.0, 1.0, 0.0, 0.0]))  # the blend picked token 1
    assert miss["full_rank_of_top1"] == 1 and miss["full_gap_to_top1"] == pytest.approx(0.5)
    assert miss["full_top2_gap"] == pytest.approx(0.5) and miss["full_p_of_top1"] < miss["full_p_top1"]
    ref = {"passage_tokens": [10], "reordered_top1": 1.0}
    for i, (top1, detail) in enumerate([(0.0, miss), (1.0, lengths.top1_detail(full, full))]):
        key = f"tiny|toy|0|q{i}"
        cache.data[key] = {"ref": dict(ref), "runs": {v.key(0.15): {"kl": 0.2, "top1": top1} | detail}}
        cache.logits[key] = full
    cache.save()
    got = lengths.explain_misses(None, "tiny", rows, [0], {"default": v}, tmp_path / "c.json")
    assert [m["id"] for m in got] == ["q0"]  # q1 agrees everywhere: not listed
    assert got[0]["misses"]["default"]["full_rank_of_top1"] == 1
    assert got[0]["full_top2_gap"] == pytest.approx(0.5)


def test_integrated_gradients_sum_to_full_reuses_kl(tiny_runner):
    """The question pass over a cache is full reuse's (over the cached K/V) and full prefill's (over
    the exact ones); the attributions along the path between them add up to full reuse's KL."""
    from benchmarks.common.scoring import kl
    from benchmarks.quality import oracle
    from blend_engine.types import BlendPlan

    engine = BlendEngine(tiny_runner, MemoryStore(1 << 28, kv_format="fp32"), SWEEP_CONFIG)
    ex = _example(1)
    plan = BlendPlan(tuple(p.text for p in ex.paragraphs), ex.question)
    lengths.cache_segments(engine, plan)
    full = engine.prefill(BlendPlan(plan.passages, plan.question, mode="full_prefill"), max_new_tokens=1)
    reuse = engine.prefill(BlendPlan(plan.passages, plan.question, mode="full_reuse"), max_new_tokens=1)
    n = full.layout.n_tokens
    over_reuse = oracle.question_pass(tiny_runner, [k[:, :n] for k in reuse.cache.k], [v[:, :n] for v in reuse.cache.v],
                                      full.layout)
    assert (over_reuse - reuse.logits).abs().max().item() < 1e-3
    refs = oracle.oracle_refs(engine, plan)
    attr = refs.scores["ig"]  # [P]
    assert attr.shape == refs.compete.shape
    assert attr.sum().item() == pytest.approx(kl(full.logits, reuse.logits), rel=0.1)
    assert attr.max() > 0
