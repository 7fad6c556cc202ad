"""The benchmark harness end to end on 2 real examples with the tiny random Llama (fast, not meaningful)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.common.data import (
    DATA_ENV,
    HOTPOTQA_FILE,
    MUSIQUE_FILE,
    build_context,
    default_data_dir,
    group_paragraphs,
    load_examples,
    passages_of,
    read_examples,
    select_paragraphs,
    shuffled,
)
from benchmarks.load.throughput import request_bodies
from benchmarks.peers import peer
from benchmarks.quality.quality import mode_specs
from benchmarks.run import BenchConfig, parse_args, run_benchmark
from tests.helpers import requires_shared_data

needs_data = requires_shared_data(MUSIQUE_FILE, HOTPOTQA_FILE)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_shared_data_dir_is_overridable(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_ENV, raising=False)
    assert default_data_dir().parts[-2:] == ("shared", "data")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert default_data_dir() == tmp_path
    (tmp_path / MUSIQUE_FILE).write_text(json.dumps({"id": "m", "question": "Q?", "answer": "A", "paragraphs": [
        {"title": "T", "paragraph_text": " text ", "is_supporting": True}]}) + "\n")
    assert load_examples("musique", 5)[0].paragraphs[0].text == "text"


@needs_data
def test_loaders_read_the_shared_data():
    mus = load_examples("musique", 2)
    hot = load_examples("hotpotqa", 2)
    assert len(mus) == 2 and len(hot) == 2
    assert len(mus[0].paragraphs) == 20 and len(hot[0].paragraphs) == 10
    assert mus[0].answers[0] == "Adrian Edmondson" and len(mus[0].answers) >= 1
    assert sum(p.supporting for p in hot[0].paragraphs) == 2
    assert hot[0].paragraphs[0].text and not hot[0].paragraphs[0].text.startswith(" ")


@needs_data
def test_read_examples_detects_the_layout_per_file(tmp_path):
    d = default_data_dir()
    assert read_examples(d / MUSIQUE_FILE, 2, offset=1) == load_examples("musique", 2, offset=1)
    assert read_examples(d / HOTPOTQA_FILE, 2) == load_examples("hotpotqa", 2)
    foreign = tmp_path / "other.jsonl"
    foreign.write_text(json.dumps({"id": "q1", "question": "?", "passages": []}) + "\n")
    with pytest.raises(ValueError, match="neither MuSiQue"):
        read_examples(foreign, 1)
    with pytest.raises(FileNotFoundError):
        read_examples(tmp_path / "missing.jsonl", 1)


@needs_data
def test_paragraph_selection_grouping_and_shuffle():
    ex = load_examples("musique", 1)[0]
    picked = select_paragraphs(ex, 4)
    assert len(picked) == 4
    assert all(p in picked for p in ex.paragraphs if p.supporting)
    assert [ex.paragraphs.index(p) for p in picked] == sorted(ex.paragraphs.index(p) for p in picked)
    groups = group_paragraphs(ex.paragraphs, 350)
    assert 2 <= len(groups) < len(ex.paragraphs)
    assert all(len(g.split()) <= 350 + max(len(p.text.split()) for p in ex.paragraphs) + 20 for g in groups)
    passages = passages_of(ex)
    assert passages[0].startswith(ex.paragraphs[0].title + "\n")
    order = shuffled(passages, ex.id)
    assert sorted(order) == sorted(passages) and order[0] != passages[0]
    assert shuffled(passages, ex.id) == order  # deterministic


@needs_data
def test_context_builder_hits_the_target():
    examples = load_examples("musique", 3)
    ctx = build_context(examples, 1500, lambda t: len(t.split()) * 2)
    assert 1200 < ctx.n_tokens <= 1500
    assert ctx.question == examples[0].question


@needs_data
def test_request_bodies_match_the_api_schema():
    bodies = request_bodies(load_examples("musique", 2), 3, 8)
    assert len(bodies) == 2 and len(bodies[0]["documents"]) == 3
    assert set(bodies[0]) == {"question", "max_tokens", "temperature", "documents"}
    assert set(bodies[0]["documents"][0]) == {"title", "text"}


def test_peer_is_skipped_with_a_message_when_llama_cpp_is_missing(monkeypatch):
    monkeypatch.setattr(peer.importlib.util, "find_spec", lambda name: None)
    ok, why = peer.available()
    assert not ok and "llama-cpp-python" in why


def test_cli_presets():
    quick, out, readme = parse_args(["--quick", "--skip", "peer,throughput", "--no-readme"])
    full, _, _ = parse_args(["--full", "--max-paragraphs", "0"])
    assert quick.skip == ("peer", "throughput") and not readme
    assert full.max_paragraphs is None and max(full.perf_tokens) == 6000
    assert quick.n_musique >= 10 and quick.n_hotpotqa >= 10 and quick.max_paragraphs == 4


@needs_data
def test_harness_end_to_end(tiny_runner, tmp_path):
    cfg = BenchConfig(n_musique=1, n_hotpotqa=1, max_paragraphs=3, max_tokens=4, perf_tokens=(300,),
                      tiers=("ram", "disk"), skip=("throughput", "peer"), threads=1, command="test")
    readme = tmp_path / "README.md"
    readme.write_text("# Bench\n\nintro\n")
    results = run_benchmark(cfg, tmp_path / "out", runner=tiny_runner, readme=readme)

    out = tmp_path / "out"
    data = json.loads((out / "results.json").read_text())
    names = [s.name for s in mode_specs()]
    assert len(data["records"]) == 2 * len(names)
    rec = data["records"][0]
    assert set(rec) >= {"dataset", "id", "mode", "answer", "f1", "em", "agreement_f1", "kl", "recompute_share", "ttft_ms"}
    by_mode = {r["mode"]: r for r in data["records"] if r["dataset"] == "musique"}
    assert set(by_mode) == set(names)
    assert by_mode["full_prefill"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert by_mode["full_prefill"]["agreement_f1"] == 1.0
    assert by_mode["full_prefill"]["recompute_share"] == 1.0
    assert by_mode["full_reuse"]["recompute_share"] < by_mode["blend@0.30"]["recompute_share"] < 1.0
    assert by_mode["blend@0.05"]["recompute_share"] < by_mode["blend@0.30"]["recompute_share"]
    assert by_mode["blend@auto"]["recompute_ratio"] >= 0.15  # the controller's floor
    assert by_mode["full_reuse"]["kl"] > 0.0  # reused caches lack cross-attention: the distribution moves

    q = data["quality"]
    assert set(q["table"]) == {"musique", "hotpotqa", "all"}
    f1 = q["table"]["all"]["blend@0.15"]["f1"]
    assert set(f1) == {"mean", "low", "high"} and f1["low"] <= f1["mean"] <= f1["high"]
    assert "blend@0.15 - full_prefill (f1)" in q["paired"]["all"]
    assert "blend015_within_0.02_f1" in q["goals"]
    vs_order = q["paired"]["all"]["blend@0.15 - prefix_cache (f1)"]
    assert "blend@0.15 - prefix_cache (agreement_f1)" in q["paired"]["all"]
    assert q["goals"]["blend015_f1_minus_reordered_exact_prefill"] == vs_order["mean"]

    perf = data["perf"]
    assert {(r["tier"], r["mode"]) for r in perf} == {("-", "full_prefill")} | {
        (t, m) for t in ("ram", "disk") for m in ("prefix_cache", "full_reuse", "blend@0.15")}
    assert all(r["ttft_ms"] > 0 and r["context_tokens"] > 250 for r in perf)
    assert all(r["speedup_vs_full_prefill"] > 0 for r in perf)

    for png in ("f1_vs_ratio.png", "ttft_vs_context.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "| blend@0.15 |" in md and "F1 vs ratio" in md and "speedup" in md
    text = readme.read_text()
    assert text.startswith("# Bench\n\nintro") and "](out/f1_vs_ratio.png)" in text and "### Latest results" in text
    run_benchmark(cfg, tmp_path / "out", runner=tiny_runner, readme=readme)  # refresh replaces, never appends
    assert readme.read_text().count("### Latest results") == 1
    assert results["meta"]["command"] == "test"


@needs_data
def test_prefix_cache_is_timed_on_orders_it_has_not_cached(tiny_runner, monkeypatch):
    """Each trial of prefix_cache (shuffled) must use an order no earlier request cached, or trials
    after the first would time a prefix-cache hit; the engine bench's rotations likewise."""
    from benchmarks.ttft import perf
    from benchmarks.ttft.engine import _speed_cases

    timed: dict[str, list[tuple[str, ...]]] = {}

    def fake_ttft(engine, plans):
        timed.setdefault(plans[0].mode.value, []).extend(p.passages for p in plans)
        return 1.0, 0.0, 0.0

    monkeypatch.setattr(perf, "ttft", fake_ttft)
    ctx = build_context(load_examples("musique", 2), 1200, lambda t: len(tiny_runner.encode(t)))
    assert len(ctx.passages) >= 3
    perf.measure_context(tiny_runner, ctx, 1200, ("ram",), trials=3)
    orders = timed["prefix_cache"]
    assert len(orders) == 3 and len(set(orders)) == 3 and ctx.passages not in orders
    assert timed["blend"] == [ctx.passages] * 3

    cases = dict(_speed_cases(ctx.passages, ctx.question, {}))
    rotations = [cases["prefix_cache (shuffled)"](i).passages for i in range(len(ctx.passages) - 1)]
    assert len(set(rotations)) == len(rotations) and ctx.passages not in rotations
    assert all(sorted(r) == sorted(ctx.passages) for r in rotations)


@pytest.mark.parametrize("spec", ["0.15,2", "abc", ""])
def test_engine_bench_refuses_bad_ratios_before_loading_the_model(spec, monkeypatch):
    from benchmarks.ttft import engine as bench

    monkeypatch.setattr(bench.ModelRunner, "load", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(SystemExit, match="--ratios"):
        bench.main(["--ratios", spec, "--skip", "speed,ablation"])


def test_serving_reads_engine_step_times_from_two_scrapes():
    """`benchmarks.load.serving`: a level's mean step by kind and the cores busy, from /metrics counters."""
    from benchmarks.load.serving import STEP_SERIES, _gauges, _steps, engine_busy

    def scrape(decode_n, decode_s, prefill_n, prefill_s, cpu_s):
        values = dict(zip(STEP_SERIES, (decode_n, prefill_n, decode_s, prefill_s, cpu_s)))
        return _gauges("\n".join(f"{k} {v}" for k, v in values.items()) + "\nother_total 1.0")

    first, last = scrape(10, 1.0, 2, 1.0, 3.0), scrape(30, 3.0, 4, 2.0, 9.0)
    decode_ms, prefill_ms, cores = _steps(first, last)
    assert (decode_ms, prefill_ms, cores) == pytest.approx((100.0, 500.0, 2.0))
    assert all(v != v for v in _steps(first, first))  # nothing ran: NaN, not a division error
    assert engine_busy(first, last, seconds=6.0) == pytest.approx(0.5)  # 3 s of steps in a 6 s level


def test_serving_rates_the_prefill_work_per_token_layer():
    """Prefill steps' seconds over the prefill token-layers they ran, between two scrapes (NaN: none ran)."""
    from benchmarks.load.serving import TOKEN_LAYERS, _gauges, _step_series, prefill_rate_us

    def scrape(token_layers, prefill_s):
        return _gauges(f"{TOKEN_LAYERS} {token_layers}\n{_step_series('step_seconds', 'prefill')} {prefill_s}\n"
                       f"{_step_series('step_seconds', 'decode')} 7.0")

    first, last = scrape(1_000, 0.5), scrape(6_000, 1.0)
    assert prefill_rate_us(first, last) == pytest.approx(100.0)  # 0.5 s over 5,000 token-layers
    assert prefill_rate_us(first, first) != prefill_rate_us(first, first)


def test_serving_counts_only_the_tokens_streamed_while_every_client_had_a_request():
    """Each answer's tokens spread over its deltas; those after the window's end are the drain's."""
    from benchmarks.load.serving import _Sample, full_tokens_per_s

    t0 = 100.0
    early = _Sample(1.0, [], 4, (100.5, 101.0, 101.5, 102.0))  # all 4 tokens inside [100, 102]
    late = _Sample(1.0, [], 6, (101.0, 103.0, 104.0))  # 2 of 6 tokens inside (one delta of three)
    assert full_tokens_per_s([early, late], t0, 2.0) == pytest.approx((4 + 2) / 2.0)
    assert full_tokens_per_s([early], t0, 0.0) != full_tokens_per_s([early], t0, 0.0)  # an empty window: NaN


def test_serving_paired_levels_turn_prefix_caching_off_and_refuse_what_would_break_them():
    """`--same-questions N`: every level asks the same N questions, so no level may take an earlier
    level's prompts from the pool (prefix caching off), and N must cover the largest level's clients."""
    from benchmarks.load.serving import PREFIX_CACHING, paired_settings

    assert paired_settings({"BLENDSERVE_ENGINE_MAX_BATCH": "16"}, 48, [1, 8, 16]) == {
        "BLENDSERVE_ENGINE_MAX_BATCH": "16", PREFIX_CACHING: "false"}
    assert paired_settings({PREFIX_CACHING: "False"}, 16, [16])[PREFIX_CACHING] == "false"
    with pytest.raises(SystemExit, match="at least 32"):
        paired_settings({}, 16, [1, 32])
    with pytest.raises(SystemExit, match="hit an earlier"):
        paired_settings({PREFIX_CACHING: "true"}, 48, [1, 8])


def test_serving_prints_each_levels_tokens_per_second_over_one_clients():
    """The scaling line per max_tokens: levels over the 1-client level, 16 over 8, with #35's goals."""
    from benchmarks.load.serving import ServingRow, scaling

    def row(mt: int, clients: int, tps: float) -> ServingRow:
        return ServingRow(mt, clients, 8, 8, 0, 0, 1.0, 1.0, tps, 0.0, 0.0, 0.0, 0.0)

    rows = [row(128, 1, 20.0), row(128, 8, 40.0), row(128, 16, 50.0), row(32, 8, 9.0)]
    assert scaling(rows, natural=True) == ("max_tokens 128: tokens/s over one client's: 8 clients 2.00x, "
                                           "16 clients 2.50x (8 / 1 goal 2.5x); 16 / 8 1.25x (goal 1.3x)")
    assert "8 / 1 goal 3x" in scaling(rows, natural=False)
    assert scaling([row(32, 8, 9.0)], natural=True) == ""  # no 1-client level: nothing to divide by
