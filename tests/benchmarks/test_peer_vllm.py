"""The vLLM peer comparison's pure parts (issue #37): KL, report assembly, arguments, the failure
messages. Fast, and without vLLM: no server is started."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peers import peer_vllm, peer_vllm_report, peer_vllm_servers
from benchmarks.peers.peer_vllm_client import Reply, blend_body, sse_events, token_text_of, vllm_body
from benchmarks.peers.peer_vllm_report import (
    BLEND,
    NEW_COMBINATION,
    PAIR,
    REPEATED,
    VLLM,
    LoadRow,
    RagSample,
    Report,
    kl_top,
    load_table,
    merge_top,
    targets,
    ttft_summary,
    write_atomic,
    write_results,
)
from benchmarks.peers.peer_vllm_servers import PeerSetupError, VllmSettings


def _dist(probs: dict[str, float]) -> dict[str, float]:
    return {t: math.log(p) for t, p in probs.items()}


# ----------------------------------------------------------------------------- KL


def test_kl_of_a_distribution_with_itself_is_zero():
    p = _dist({"a": 0.5, "b": 0.3, "c": 0.1})
    assert kl_top(p, p) == pytest.approx(0.0, abs=1e-12)


def test_kl_matches_the_bucketed_formula():
    p = _dist({"a": 0.6, "b": 0.3})  # rest 0.1
    q = _dist({"a": 0.3, "b": 0.5})  # rest 0.2
    expected = 0.6 * math.log(0.6 / 0.3) + 0.3 * math.log(0.3 / 0.5) + 0.1 * math.log(0.1 / 0.2)
    assert kl_top(p, q) == pytest.approx(expected)
    assert kl_top(q, p) != pytest.approx(expected)  # not symmetric


def test_kl_gives_a_token_the_candidate_does_not_list_its_smallest_listed_logprob():
    p = _dist({"a": 0.5, "z": 0.4})
    q = _dist({"a": 0.5, "b": 0.2, "c": 0.05})
    q_z = 0.05
    rest_p, rest_q = 0.1, 1 - 0.5 - q_z
    expected = 0.4 * math.log(0.4 / q_z) + rest_p * math.log(rest_p / rest_q)
    assert kl_top(p, q) == pytest.approx(expected)


def test_kl_needs_both_distributions():
    with pytest.raises(ValueError):
        kl_top({}, _dist({"a": 1.0}))


def test_merge_top_sums_tokens_with_the_same_text():
    merged = merge_top([("", math.log(0.2)), ("a", math.log(0.5)), ("", math.log(0.1))])
    assert merged["a"] == pytest.approx(math.log(0.5))
    assert merged[""] == pytest.approx(math.log(0.3))


def test_token_ids_are_decoded_and_plain_texts_kept():
    text = token_text_of(lambda ids: f"<{ids[0]}>")
    assert text("token_id:42") == "<42>"
    assert text("Paris") == "Paris"


# ----------------------------------------------------------------------------- report assembly


def _rag(system: str, case: str, ms: float, size: int = 4000) -> RagSample:
    return RagSample(system, case, "musique", size, size - 10, ms)


def test_ttft_summary_gives_p50_and_p95_per_system_case_and_size():
    values = [100.0, 200.0, 300.0, 1000.0]
    samples = [_rag(VLLM, "cold", v) for v in values] + [_rag(VLLM, "cold", 50.0, size=2000)]
    rows = {(r["case"], r["size"]): r for r in ttft_summary(samples)}
    row = rows["cold", 4000]
    assert row["n"] == 4
    assert row["ttft_p50_ms"] == pytest.approx(250.0)
    assert row["ttft_p95_ms"] == pytest.approx(300 + 0.85 * 700)
    assert rows["cold", 2000]["ttft_p50_ms"] == 50.0


def test_targets_are_computed_from_the_medians():
    report = Report({}, [_rag(VLLM, "reordered", 9000), _rag(BLEND, "reordered_blend", 2000),
                         _rag(VLLM, "same_order", 200), _rag(BLEND, "same_order_blend", 400),
                         _rag(VLLM, "cold", 1000), _rag(BLEND, "cold_full_prefill", 900)],
                    [LoadRow(BLEND, 8, 8, 8, 0, 1.0, 40, 40.0, 1, 2), LoadRow(VLLM, 8, 8, 8, 0, 1.0, 50, 50.0, 1, 2),
                     LoadRow(BLEND, 1, 4, 4, 0, 1.0, 5, 5.0, 1, 2), LoadRow(VLLM, 1, 4, 4, 0, 1.0, 9, 9.0, 1, 2)])
    got = {t["target"]: t for t in targets(report)}
    assert got["reordered @4000: vLLM / Blendserve blend TTFT"]["value"] == pytest.approx(4.5)
    assert got["reordered @4000: vLLM / Blendserve blend TTFT"]["met"] is True
    assert got["same order @4000: Blendserve blend / vLLM prefix hit TTFT"]["value"] == pytest.approx(2.0)
    assert got["same order @4000: Blendserve blend / vLLM prefix hit TTFT"]["met"] is False
    assert got["cold @4000: Blendserve full prefill / vLLM TTFT"]["met"] is True
    assert got["8 clients: Blendserve / vLLM tokens/s"]["value"] == pytest.approx(0.8)
    assert got["8 clients: Blendserve / vLLM tokens/s"]["met"] is True
    assert not any(name.startswith("1 clients") for name in got)  # the load target is for 8 and 16 clients


def test_the_pairs_targets_compare_it_with_vllm_alone_per_kind_of_load():
    """Issue #55's targets: the pair's reordered and repeated TTFT against vLLM's, its tokens/s on
    repeated prompts at every level and on new combinations at 8 clients."""
    def row(system: str, clients: int, rate: float, kind: str) -> LoadRow:
        return LoadRow(system, clients, 8, 8, 0, 1.0, int(rate), rate, 1, 2, kind=kind)

    report = Report({}, [_rag(VLLM, "reordered", 9000), _rag(PAIR, "reordered_blend", 2000),
                         _rag(VLLM, "same_order", 200), _rag(PAIR, "same_order_blend", 230)],
                    [row(VLLM, 8, 50.0, NEW_COMBINATION), row(PAIR, 8, 80.0, NEW_COMBINATION),
                     row(VLLM, 8, 60.0, REPEATED), row(PAIR, 8, 51.0, REPEATED),
                     row(VLLM, 1, 20.0, REPEATED), row(PAIR, 1, 19.0, REPEATED)])
    got = {t["target"]: t for t in targets(report)}
    assert got["reordered @4000: vLLM / Blendserve+vLLM TTFT"]["value"] == pytest.approx(4.5)
    assert got["same prompt again @4000: Blendserve+vLLM / vLLM TTFT"]["value"] == pytest.approx(1.15)
    assert got["same prompt again @4000: Blendserve+vLLM / vLLM TTFT"]["met"] is True
    assert got["8 clients, repeated prompts: Blendserve+vLLM / vLLM tokens/s"]["value"] == pytest.approx(0.85)
    assert got["8 clients, repeated prompts: Blendserve+vLLM / vLLM tokens/s"]["met"] is False
    assert got["1 clients, repeated prompts: Blendserve+vLLM / vLLM tokens/s"]["met"] is True
    assert got["8 clients, new combinations: Blendserve+vLLM / vLLM tokens/s"]["value"] == pytest.approx(1.6)
    assert "reordered @4000: vLLM / Blendserve blend TTFT" in got  # Blendserve alone keeps its own targets
    assert not any("Blendserve+vLLM" in name for name in (t["target"] for t in targets(Report({}, report.rag[:1]))))


def test_server_timings_skip_the_fields_a_decoder_leaves_null():
    """The own decoder's replies carry the vllm decoder's timings as null: the medians skip them."""
    replies = [Reply(1, 1, "x", body={"timings": {"ttft_ms": v, "blend_ms": None}}) for v in (10.0, 30.0)]
    assert peer_vllm.server_p50(replies) == {"ttft_ms": pytest.approx(20.0)}
    both = replies + [Reply(1, 1, "x", body={"timings": {"ttft_ms": 50.0, "blend_ms": 7.0}})]
    assert peer_vllm.server_p50(both) == {"ttft_ms": pytest.approx(30.0), "blend_ms": 7.0}


def test_the_prefix_hit_share_counts_the_pools_prefix_or_what_vllm_did_not_compute():
    own = [Reply(1, 1, "x", body={"stats": {"context_tokens": 100, "prefix_tokens_reused": p, "decoder": "own"}})
           for p in (96, 0)]
    assert peer_vllm.prefix_hit_share(own) == pytest.approx(0.48)
    pair = [Reply(1, 1, "x", body={"stats": {"context_tokens": 100, "prefix_tokens_reused": 0, "decoder": "vllm",
                                             "decoder_cached_tokens": 99}})]
    assert peer_vllm.prefix_hit_share(pair) == pytest.approx(0.99)
    assert peer_vllm.prefix_hit_share([Reply(1, 1, "x")]) is None  # vLLM alone: no stats


def test_a_levels_longest_answer_is_reported_with_its_first_and_last_token():
    replies = [Reply(100.0, 12, "a", total_ms=400.0), Reply(50.0, 128, "b", total_ms=5000.0), Reply(70.0, 3, "c")]
    assert peer_vllm.longest(replies) == (128, 50.0, 5000.0)
    assert peer_vllm.longest([]) is None
    table = load_table([LoadRow(VLLM, 8, 3, 3, 0, 5.0, 143, 28.6, 70, 100, load_avg_1m=1.5,
                                longest=peer_vllm.longest(replies))])
    head, _, row = (line.split(" | ") for line in table.splitlines())
    assert row[head.index("longest answer: tokens, first / last token (ms)")] == "128, 50 / 5,000"
    assert row[head.index("load 1m")] == "1.5"  # each value under its own header


def test_a_target_without_its_measurement_is_reported_unmet_as_none():
    got = targets(Report({}, [_rag(VLLM, "reordered", 9000)]))
    assert got[0]["value"] is None and got[0]["met"] is None


def test_fidelity_rows_compare_full_and_blend_with_vllm():
    p = peer_vllm.RagPrompt("hotpotqa", 2000, "q?", ("a", "b"), ("b", "a"), (1, 2), (2, 1))
    ref, full, mixed = _dist({"x": 0.7, "y": 0.2}), _dist({"x": 0.7, "y": 0.2}), _dist({"y": 0.6, "x": 0.3})
    vllm = peer_vllm.SystemRun({(0, "cold"): Reply(1, 1, "x", ref), (0, "reordered"): Reply(1, 1, "x", ref)}, [])
    blend = peer_vllm.SystemRun({(0, "cold_full_prefill"): Reply(1, 1, "x", full),
                                 (0, "same_order_blend"): Reply(1, 1, "y", mixed),
                                 (0, "reordered_blend"): Reply(1, 1, "x", full)}, [])
    (row,) = peer_vllm.fidelity_rows([p], vllm, blend)
    assert row.kl_full_vs_vllm == pytest.approx(0.0, abs=1e-12)
    assert row.kl_blend_vs_vllm == pytest.approx(kl_top(ref, mixed)) and row.kl_blend_vs_vllm > 0.1
    assert row.kl_blend_vs_full == pytest.approx(kl_top(full, mixed))
    assert row.top1_full_agrees and not row.top1_blend_agrees


def test_write_results_writes_json_markdown_and_plot(tmp_path: Path):
    report = Report({"cores": "0-1"}, [_rag(VLLM, "cold", 1000), _rag(BLEND, "cold_full_prefill", 1500)],
                    [LoadRow(BLEND, 1, 4, 4, 0, 2.0, 20, 10.0, 100, 150)])
    files = write_results(report, tmp_path, "peer")
    assert sorted(p.name for p in files) == ["peer.json", "peer.md", "peer.png"]
    data = json.loads((tmp_path / "peer.json").read_text())
    assert data["settings"] == {"cores": "0-1"}
    assert {(r["system"], r["case"]) for r in data["rag_summary"]} == {(VLLM, "cold"), (BLEND, "cold_full_prefill")}
    assert "| 1 | blendserve | 4 / 4 | 10.0 | 100 / 150 |" in (tmp_path / "peer.md").read_text()
    assert (tmp_path / "peer.png").read_bytes()[:4] == b"\x89PNG"


def test_no_result_file_is_written_when_rendering_fails(tmp_path: Path, monkeypatch):
    def broken(report):
        raise RuntimeError("no plot")

    monkeypatch.setattr(peer_vllm_report, "plot_png", broken)
    with pytest.raises(RuntimeError):
        write_results(Report({}, [_rag(VLLM, "cold", 1000)]), tmp_path, "peer")
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_keeps_the_old_file_when_the_rename_fails(tmp_path: Path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(peer_vllm_report.os, "replace", fail)
    with pytest.raises(OSError):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left


# ----------------------------------------------------------------------------- requests


def test_bodies_are_greedy_and_streamed():
    v = vllm_body([1, 2, 3], 16, logprobs=True)
    assert v["prompt"] == [1, 2, 3] and v["temperature"] == 0.0 and v["stream"] and v["logprobs"] == 20
    assert v["return_tokens_as_token_ids"] is True
    assert "logprobs" not in vllm_body([1], 16, logprobs=False)
    b = blend_body(("p1", "p2"), "q?", 1, "full_prefill", logprobs=True)
    assert b["documents"] == [{"text": "p1"}, {"text": "p2"}] and b["mode"] == "full_prefill"
    assert b["temperature"] == 0.0 and b["top_logprobs"] == 20


def test_sse_events_pair_each_data_line_with_its_event():
    async def lines():
        for line in ["event: delta", "data: {\"text\": \"a\"}", "", "data: [DONE]", "event: done", "data: {}"]:
            yield line

    async def collect():
        return [e async for e in sse_events(lines())]

    assert asyncio.run(collect()) == [("delta", '{"text": "a"}'), (None, "[DONE]"), ("done", "{}")]


def test_blendserve_cases_name_their_modes():
    p = peer_vllm.RagPrompt("musique", 2000, "q?", ("a", "b"), ("b", "a"), (1,), (2,))
    cases = dict(peer_vllm.blend_cases(p, prefix_cache=False))
    assert {name: c["mode"] for name, c in cases.items()} == {
        "cold_blend_ingest": "blend", "cold_full_prefill": "full_prefill", "same_order_blend": "blend",
        "reordered_blend": "blend"}
    assert cases["reordered_blend"]["documents"] == [{"text": "b"}, {"text": "a"}]
    assert "same_order_prefix_cache" in dict(peer_vllm.blend_cases(p, prefix_cache=True))


# ----------------------------------------------------------------------------- arguments


def test_quick_means_one_question_per_size_and_one_round():
    args = peer_vllm.parse_args(["--quick", "--questions", "5"])
    assert (args.questions, args.rounds) == (1, 1) and "prefix_cache" in args.skip
    assert args.sizes == [2000, 4000, 7600] and args.clients == [1, 8, 16]
    assert peer_vllm.rag_plan(args) == [("musique", 2000), ("hotpotqa", 4000), ("musique", 7600)]


def test_a_full_run_asks_every_dataset_at_every_size():
    args = peer_vllm.parse_args(["--questions", "2", "--sizes", "2000,4000"])
    plan = peer_vllm.rag_plan(args)
    assert len(plan) == 2 * 2 * 2 and plan.count(("hotpotqa", 4000)) == 2
    assert "prefix_cache" not in args.skip


@pytest.mark.parametrize("argv", [["--sizes", "100"], ["--sizes", "9000"], ["--sizes", "2k"], ["--clients", "0"],
                                  ["--datasets", "squad"], ["--skip", "decode"], ["--questions", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        peer_vllm.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


# ----------------------------------------------------------------------------- servers and failures


def test_vllm_server_command_and_environment():
    s = VllmSettings(cores="0-1", kv_space_gb=3)
    cmd = peer_vllm_servers.vllm_command(Path("/v/bin/python"), Path("/m"), s, 8123)
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--dtype") + 1] == "float32"
    assert "--enable-prefix-caching" in cmd
    env = peer_vllm_servers.vllm_env({"VLLM_CPU_KVCACHE_SPACE": "40", "PATH": "/bin"}, s, Path("/nowhere"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["PATH"] == "/bin" and "LD_PRELOAD" not in env


def test_blendserve_runs_on_its_scratch_dir_without_inherited_settings(tmp_path: Path):
    env = peer_vllm_servers.blendserve_env({"BLENDSERVE_DEFAULT_MODE": "full_reuse"}, tmp_path, 9000)
    assert env["BLENDSERVE_DATA_DIR"] == str(tmp_path) and env["BLENDSERVE_SERVICE_PORT"] == "9000"
    assert "BLENDSERVE_DEFAULT_MODE" not in env


def test_blendserve_gets_current_setting_names_only(tmp_path: Path, monkeypatch, caplog):
    """The service reads every name the benchmark sets, none of them a deprecated alias."""
    from app.settings import ServiceSettings

    env = peer_vllm_servers.blendserve_env({}, tmp_path, 9000)
    monkeypatch.chdir(tmp_path)  # no .env
    for name in [k for k in os.environ if k.startswith("BLENDSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("BLENDSERVE_"):
            monkeypatch.setenv(name, value)
    with caplog.at_level("WARNING"):
        s = ServiceSettings()
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]
    assert s.service.port == 9000 and s.model.dtype == "float32" and s.service.max_queue == 64
    assert s.data_dir == tmp_path


def test_blendserve_counts_as_up_once_its_fidelity_gate_is_done():
    settled = peer_vllm_servers.blend_settled
    assert not settled({"ready": False, "blend": None})
    assert not settled({"ready": True, "blend": {"state": "checking", "reason": "the gate is running"}})
    assert settled({"ready": True, "blend": {"state": "on", "reason": "blend passed the fidelity gate"}})
    assert settled({"ready": True, "blend": {"state": "off", "reason": "blend failed"}})  # measured as served


def test_blendserve_measures_its_cold_blend_before_its_full_prefill():
    p = peer_vllm.RagPrompt("musique", 2000, "q?", ("a", "b"), ("b", "a"), (1, 2), (2, 1))
    names = [name for name, _ in peer_vllm.blend_cases(p, prefix_cache=False)]
    assert names.index("cold_blend_ingest") < names.index("cold_full_prefill") < names.index("same_order_blend")


def test_a_missing_vllm_venv_names_the_install_target(tmp_path: Path):
    with pytest.raises(PeerSetupError, match="make bench-peer-vllm-install") as exc:
        peer_vllm_servers.vllm_python(tmp_path / ".venv-vllm")
    assert str(tmp_path / ".venv-vllm") in str(exc.value)


def test_an_unfinished_install_is_refused(tmp_path: Path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    with pytest.raises(PeerSetupError, match="incomplete.*make bench-peer-vllm-install"):
        peer_vllm_servers.vllm_python(tmp_path)


def test_main_without_the_venv_exits_non_zero_and_writes_nothing(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(peer_vllm_servers, "VLLM_VENV", tmp_path / "absent")
    out = tmp_path / "out"
    assert peer_vllm.main(["--quick", "--out-dir", str(out)]) == 2
    assert "make bench-peer-vllm-install" in capsys.readouterr().err
    assert not out.exists()


def test_a_server_that_exits_names_its_log_and_the_target(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(30)
    log = tmp_path / "vllm.log"
    with pytest.raises(PeerSetupError) as exc:
        peer_vllm_servers.wait_up(lambda: False, proc, "the vLLM server", log, timeout_s=30)
    message = str(exc.value)
    assert "exited with code 3" in message and str(log) in message and "make bench-peer-vllm" in message


def test_a_server_that_never_answers_times_out_with_its_log(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(PeerSetupError, match="did not come up within") as exc:
            peer_vllm_servers.wait_up(lambda: False, proc, "the vLLM server", tmp_path / "v.log", timeout_s=0.3,
                                      interval_s=0.05)
        assert str(tmp_path / "v.log") in str(exc.value)
    finally:
        proc.kill()
        proc.wait(30)
