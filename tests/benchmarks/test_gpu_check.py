"""The GPU check's carried-weights codec (3-bit groups) and its report, on the CPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu.gpu_check import markdown
from benchmarks.gpu.gpu_pack import GROUP, pack3, unpack3


def test_three_bit_packing_round_trips_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(37, 300) * torch.linspace(0.1, 3.0, 300)  # not a multiple of the group size
    p = pack3(w)
    assert p["codes"].dtype == torch.uint8 and p["codes"].numel() * 8 == 3 * p["scale"].numel() * GROUP
    back = unpack3(p["codes"], p["scale"], p["low"], w.shape, torch.float32)
    step = p["scale"].float().repeat_interleave(GROUP)[: w.numel()].view(w.shape)
    assert back.shape == w.shape
    assert ((back - w).abs() <= step / 2 + 1e-3).all()
    assert (back - w).abs().mean() < 0.35 * w.abs().mean()  # 3 bits: 8 levels over each group's range


def test_report_renders_a_partial_run():
    env = {"device_name": "X", "torch": "t", "transformers": "t"}
    assert "GPU check" in markdown({"environment": env, "reps": 3})
    row = {"tokens": 8192, "layout_ms": 1.0, "hf_forward_ms": 100.0, "full_prefill_ms": 110.0,
           "blend@0.15 pinned RAM_ms": 30.0, "blend@0.15 GPU_ms": 29.0, "blend@auto local disk_ms": 100.0,
           "auto_served_by": "full_prefill", "auto_ratio": 1.0}
    text = markdown({"environment": env, "reps": 3, "correctness": {"model": "m", "dtype": "bf16", "kv_format": "bf16",
                     "rows": [], "pass": True}, "timing_model": "8b", "ttft": {"rows": [row]}})
    assert "| 8192 |" in text and "3.67x" in text and "full_prefill (1.00)" in text


def test_a_failing_part_is_recorded_and_the_rest_still_runs(tmp_path, monkeypatch):
    import json

    import benchmarks.gpu.gpu_check as gc

    def broken(*_a, **_k):
        raise RuntimeError("CUDA error: out of memory (simulated)")

    class Runner:
        name, dtype = "stub", "bf16"

    monkeypatch.setattr(gc, "check_correctness", broken)
    monkeypatch.setattr(gc, "_preflight", lambda *_a: True)
    monkeypatch.setattr(gc, "time_decode_floor", lambda *_a: {"tokens": 512, "step_ms": 2.0, "floor_ms": 1.0,
                        "copy_gb_per_s": 10.0, "over_floor": 2.0})
    monkeypatch.setattr(gc, "_tokenizer", lambda _p: None)
    monkeypatch.setattr(gc, "random_runner", lambda *_a: Runner())
    monkeypatch.setattr(gc, "time_ttft", lambda *_a: broken())
    monkeypatch.setattr(gc, "time_attention", lambda s, n, r, reps: {"tokens": n, "rows": 1, "bool_mask_ms": 1.0,
                        "bool_mask_expanded_kv_ms": 1.0, "float_mask_ms": 1.0, "blocks_ms": 1.0, "full_causal_ms": 1.0})
    monkeypatch.setattr(gc, "time_ingestion", lambda *_a: {"passages": 8, "passage_tokens": 256, "batch": 8,
                        "one_at_a_time_passages_per_s": 1.0, "batched_passages_per_s": 2.0})
    monkeypatch.setattr(gc, "time_batched", lambda *_a: {"tokens": 512, "max_tokens": 8, "rows": [
        {"clients": 2, "answers_per_s": 1.0, "tokens_per_s": 8.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0,
         "itl_p50_ms": 1.0, "itl_p99_ms": 2.0, "max_batch_seen": 2}]})
    monkeypatch.setattr(gc, "profile_runs", lambda *_a: broken())
    result = gc.run(tmp_path, smoke=True, smollm=None, lengths=[512], reps=1)
    assert set(result["errors"]) == {"correctness", "ttft 512", "profile"} and not result["correctness"]["pass"]
    assert result["attention"] and result["ingestion"]["batched_passages_per_s"] == 2.0
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "out of memory" in saved["errors"]["ttft 512"]
    assert "ttft 512 failed" in (tmp_path / "gpu_check.md").read_text()
    assert "| 2 | 1.00 | 8.0 |" in (tmp_path / "gpu_check.md").read_text()  # the batched run's table


def test_a_failing_variant_or_flex_timing_is_recorded_in_its_row():
    from benchmarks.gpu.gpu_timing import recorded

    assert "ZeroDivisionError" in recorded("flex", lambda: {"x": 1 / 0})["flex_error"]
    assert recorded("flex", lambda: {"flex_ms": 1.0}) == {"flex_ms": 1.0}
    env = {"device_name": "X", "torch": "t", "transformers": "t"}
    row = {"tokens": 8192, "hf_forward_ms": 100.0, "full_prefill_ms": 110.0, "blend@0.15 pinned RAM_ms": 30.0,
           "blend@0.15 GPU_ms": 29.0, "blend@auto local disk_ms": 100.0, "auto_served_by": "blend", "auto_ratio": 0.2,
           "variants_error": "Traceback ...\nRuntimeError: compile failed"}
    attention = {"tokens": 8192, "rows": 1228, "bool_mask_ms": 1.0, "bool_mask_expanded_kv_ms": 1.0,
                 "float_mask_ms": 1.0, "blocks_ms": 1.0, "full_causal_ms": 1.0, "flex_ms": 0.5,
                 "flex_block_mask_ms": 0.1, "flex_first_call_s": 20.0}
    text = markdown({"environment": env, "reps": 3, "correctness": {"model": "m", "dtype": "bf16", "kv_format": "bf16",
                     "rows": [], "pass": True}, "timing_model": "8b", "ttft": {"rows": [row]}, "attention": [attention]})
    assert "flex/int8 variants failed: `RuntimeError: compile failed`" in text
    assert "FlexAttention 0.50 ms" in text and "compile included: 20.0 s" in text


def test_columns_only_some_rows_have_are_shown_with_a_dash_elsewhere():
    env = {"device_name": "X", "torch": "t", "transformers": "t"}
    base = {"hf_forward_ms": 100.0, "full_prefill_ms": 110.0, "blend@0.15 pinned RAM_ms": 30.0,
            "blend@0.15 GPU_ms": 29.0, "blend@auto local disk_ms": 100.0, "auto_served_by": "blend", "auto_ratio": 0.2}
    rows = [{"tokens": 4096, **base}, {"tokens": 8192, **base, "blend@0.15 flex pinned RAM_ms": 25.0,
                                       "blend@0.15 int8 RAM_ms": 28.0, "flex_first_prefill_s": 31.0}]
    text = markdown({"environment": env, "reps": 3, "correctness": {"model": "m", "dtype": "bf16", "kv_format": "bf16",
                     "rows": [], "pass": True}, "timing_model": "8b", "ttft": {"rows": rows}})
    header = next(line for line in text.splitlines() if line.startswith("| tokens"))
    assert "blend@0.15 flex pinned RAM" in header and "blend@0.15 int8 RAM" in header
    assert "| 4096 | 100.0 | 110.0 | 30.0 | 29.0 | 100.0 | - | - |" in text
    assert "blend flex / default attention 0.83 (first flex prefill, compile included: 31.0 s)" in text


def test_top1_agreement_tolerates_only_a_near_tie_of_full_prefill():
    from blend_engine.selfcheck import compare

    bf16 = torch.bfloat16
    full = torch.tensor([1.0, 20.0, 19.95, 3.0], dtype=bf16)  # top two within bf16 rounding at 20
    assert compare(full, full.clone(), bf16).top1_agrees
    assert compare(full, torch.tensor([1.0, 19.9, 20.0, 3.0], dtype=bf16), bf16).top1_agrees  # flipped near-tie
    assert not compare(full, torch.tensor([1.0, 19.0, 18.0, 21.0], dtype=bf16), bf16).top1_agrees  # real disagreement
    apart = torch.tensor([1.0, 20.0, 17.0, 3.0], dtype=bf16)
    assert not compare(apart, torch.tensor([1.0, 17.0, 20.0, 3.0], dtype=bf16), bf16).top1_agrees


def test_a_failing_timing_model_is_recorded_after_correctness(tmp_path, monkeypatch):
    import json

    import benchmarks.gpu.gpu_check as gc

    def broken(*_a, **_k):
        raise RuntimeError("CUDA error: out of memory (simulated)")

    correct = {"model": "m", "dtype": "bf16", "kv_format": "bf16", "rows": [], "pass": True}
    monkeypatch.setattr(gc, "check_correctness", lambda *_a: correct)
    monkeypatch.setattr(gc, "_preflight", lambda *_a: True)
    monkeypatch.setattr(gc, "_tokenizer", broken)  # fails inside the guarded part
    result = gc.run(tmp_path, smoke=True, smollm=None, lengths=[512], reps=1)
    assert set(result["errors"]) == {"timing model"} and result["correctness"]["pass"]
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["correctness"]["pass"] and "out of memory" in saved["errors"]["timing model"]


def test_report_shows_the_service_stores_against_the_gpu():
    env = {"device_name": "X", "torch": "t", "transformers": "t"}
    row = {"tokens": 8192, "hf_forward_ms": 100.0, "full_prefill_ms": 110.0, "blend@0.15 pinned RAM_ms": 30.0,
           "blend@0.15 GPU_ms": 25.0, "blend@0.15 service RAM_ms": 27.5, "blend@0.15 service tiered disk_ms": 32.5,
           "blend@0.15 service device tier_ms": 26.0,
           "blend@auto local disk_ms": 100.0, "auto_served_by": "blend", "auto_ratio": 0.2}
    text = markdown({"environment": env, "reps": 3, "correctness": {"model": "m", "dtype": "bf16", "kv_format": "bf16",
                     "rows": [], "pass": True}, "timing_model": "8b", "ttft": {"rows": [row]}})
    assert "blend service RAM / GPU 1.10 (speedup 4.00x)" in text and "blend service disk / GPU 1.30" in text
    assert "blend service device tier / GPU 1.04" in text


def test_the_wrapper_passes_lengths_and_reps_through(tmp_path):
    import subprocess

    from tests.helpers import ROOT

    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\n')
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake)}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/gpu_check.sh"), "--smoke", str(out), "--lengths", "1024",
                           "--reps", "2"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "argv").read_text().split() == ["-m", "benchmarks.gpu.gpu_check", str(out), "--smoke",
                                                       "--lengths", "1024", "--reps", "2"]


# ---------------------------------------------------------------- issue 39: preflight, time plan, exit codes
def test_the_preflight_runs_every_path_on_the_cpu_and_passes(real_runner):
    from benchmarks.gpu.gpu_common import Setup
    from benchmarks.gpu.gpu_preflight import LAYERS, run_preflight, truncated

    setup = Setup(torch.device("cpu"), torch.bfloat16, smoke=True)
    made = []

    def factory(device, dtype, layers):
        made.append((device, dtype, layers))
        r = truncated(real_runner, layers)
        r.model.to(device=device, dtype=dtype)
        from blend_engine.model.runner import ModelRunner

        return ModelRunner(r.model, r.tokenizer, r.name)

    report = run_preflight(setup, factory)
    assert report["pass"] and report["cuda_skipped"] and report["pinned_skipped"]
    assert made == [("cpu", torch.bfloat16, LAYERS)] * 2
    assert {k for k in report if k.startswith("layers_") and k.endswith("_kl")} == {
        "layers_full_kl", "layers_blend_kl", "layers_decode_kl"}


def test_a_failing_preflight_stops_the_check_with_one_line(tmp_path, monkeypatch):
    import benchmarks.gpu.gpu_check as gc
    import benchmarks.gpu.gpu_preflight as gp

    def no_layers(*_a):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")

    monkeypatch.setattr(gp, "_layers", no_layers)
    monkeypatch.setattr(gc, "check_correctness", lambda *_a: pytest.fail("ran after a failed preflight"))
    result = gc.run(tmp_path, smoke=True, smollm=None, lengths=[512], reps=1)
    reason = result["preflight"]["reason"]
    assert reason == "layers: RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "ttft" not in result and gc.exit_code(result, strict=False) == 3
    assert "PREFLIGHT FAILED" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.parametrize("room", [(), ("profile",)])
def test_the_time_plan_skips_the_extras_first_and_says_why(tmp_path, monkeypatch, room):
    """The core always; the profile is the first extra, run when the budget has room for it."""
    import benchmarks.gpu.gpu_check as gc

    class Runner:
        name, dtype = "stub", "bf16"

    ran = []
    monkeypatch.setattr(gc, "_START", gc._START)  # restored afterwards: each stub below spends its estimate

    def spends(name, value=None):
        def stub(*args):
            gc._START -= gc.ESTIMATE_S[name]
            ran.append(f"{name} {args[2]}" if name == "ttft" else name)
            return value
        return stub

    correct = {"model": "m", "dtype": "bf16", "kv_format": "bf16", "rows": [], "pass": True}
    monkeypatch.setattr(gc, "_preflight", lambda *_a: True)
    monkeypatch.setattr(gc, "check_correctness", spends("correctness", correct))
    monkeypatch.setattr(gc, "_tokenizer", lambda _p: None)
    monkeypatch.setattr(gc, "random_runner", spends("timing model", Runner()))
    for name, attr in (("ttft", "time_ttft"), ("batched", "time_batched"), ("decode", "time_decode_floor"),
                       ("profile", "profile_runs"), ("attention", "time_attention"), ("ingestion", "time_ingestion")):
        monkeypatch.setattr(gc, attr, spends(name))
    core = sum(gc.ESTIMATE_S[k] for k in ("correctness", "timing model", "ttft", "batched", "decode") + room)
    elapsed = gc.time.perf_counter() - gc._START
    gc.run(tmp_path, smoke=False, smollm=None, lengths=[8192, 16384], reps=1, budget_s=elapsed + core + 5)
    assert ran == ["correctness", "timing model", "ttft 8192", "batched", "decode", *room]  # the core, in order
    saved = __import__("json").loads((tmp_path / "gpu_check.json").read_text())
    assert set(saved["skipped"]) == {"profile", "attention", "ingestion", "ttft 16384"} - set(room)
    assert "left of" in saved["skipped"]["ingestion"]


def test_exit_codes_and_strict_mode():
    from benchmarks.gpu.gpu_check import exit_code

    ok = {"preflight": {"pass": True}, "correctness": {"pass": True}}
    assert exit_code(ok, strict=True) == 0
    assert exit_code({**ok, "errors": {"batched": "x"}}, strict=False) == 0
    assert exit_code({**ok, "errors": {"batched": "x"}}, strict=True) == 1
    assert exit_code({**ok, "correctness": {"pass": False}}, strict=False) == 1


def test_requests_in_flight_are_counted_from_the_clients_timestamps():
    from benchmarks.gpu.gpu_batch import max_in_flight

    assert max_in_flight([[0.0, 1.0], [0.5, 2.0], [1.0, 3.0], [2.5, 4.0]]) == 3  # a shared instant counts both
    assert max_in_flight([[0.0, 1.0], [2.0, 3.0], []]) == 1


def test_the_decode_floor_counts_the_input_embeddings_only_when_the_head_shares_them():
    from benchmarks.gpu.gpu_decode import read_weight_bytes
    from tests.helpers import tiny_model

    untied, tied = tiny_model(), tiny_model(tie_word_embeddings=True)
    embed = untied.get_input_embeddings().weight
    every = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert read_weight_bytes(untied) == every - embed.numel() * embed.element_size()
    assert read_weight_bytes(tied) == sum(p.numel() * p.element_size() for p in tied.parameters())


def test_a_kl_beyond_the_dtype_bound_passes_only_when_full_prefill_is_as_far_from_fp32():
    """Correctness row: blend@1.0 beyond bf16's KL bound still passes when full prefill in bf16 is
    about as far from the fp32 answer (rounding, not the engine); not when blend@1.0 alone drifts."""
    from types import SimpleNamespace

    from benchmarks.gpu.gpu_check import _correctness_row
    from blend_engine.selfcheck import tolerance

    exact = torch.tensor([0.0, 6.0, 1.0, 0.5, 4.0])
    full = torch.tensor([0.0, 6.0, 1.8, 0.5, 3.2])
    one = torch.tensor([0.0, 6.0, 0.2, 0.5, 4.7])  # on the other side of the exact answer

    class Engine:
        runner = SimpleNamespace(dtype=torch.bfloat16)

        def __init__(self, one):
            self.by_mode = {("full_prefill", None): full, ("blend", 1.0): one, ("full_reuse", None): full + 1,
                            ("blend", 0.15): one}

        def prefill(self, plan):
            return SimpleNamespace(logits=self.by_mode[(plan.mode.value, plan.recompute_ratio)])

    row = _correctness_row(Engine(one), "memory", ["p"], "q?", exact)
    assert row["kl_ratio1"] > tolerance(torch.bfloat16).kl and not row["kl_ok"]  # beyond the dtype's bound...
    assert row["kl_ratio1_vs_fp32"] <= 2 * row["kl_full_vs_fp32"] and row["pass"]  # ...but no farther from fp32
    drift = torch.tensor([0.0, 6.0, -1.0, 0.5, 5.5])
    row = _correctness_row(Engine(drift), "memory", ["p"], "q?", exact)
    assert row["top1_agrees"] and not row["pass"]
    assert not _correctness_row(Engine(one), "memory", ["p"], "q?", None)["pass"]  # no fp32 answer: the bound rules


def test_the_batched_run_sizes_its_kv_budget_to_its_requests(tiny_runner):
    """Never a blanket budget: the paged pool allocates all of it on the device."""
    from benchmarks.gpu.gpu_batch import KV_SLACK, _config

    s = tiny_runner.shape
    per_token = 2 * s.n_layers * s.n_kv_heads * s.head_dim * tiny_runner.dtype.itemsize
    config = _config("fp16", tiny_runner, 64, 8224)
    assert config.batch.max_batch == 64
    assert config.batch.kv_budget_bytes == int(KV_SLACK * 64 * 8224 * per_token)
