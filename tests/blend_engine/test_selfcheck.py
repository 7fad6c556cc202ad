"""The start-up fidelity gate: measurement, the per-model cache, the service's fallback, the command."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import ServiceSettings
from blend_engine import selfcheck
from blend_engine.engine import EngineConfig
from blend_engine.selfcheck import GateDecision, GateResult, cache_path, decide, gate_key, run_gate
from tests.helpers import poll, wait_ready


def make_settings(data_dir, **overrides) -> ServiceSettings:
    values = {"data_dir": data_dir, "ingest_sample_on_start": False, "memory_cache_mb": 64, "disk_cache_mb": 64,
              "redis_url": None, "api_key": None, "workers": 1}
    return ServiceSettings(_env_file=None, **{**values, **overrides})


def _no_measure(*_args, **_kwargs):
    raise AssertionError("the gate measured although a cached result exists")


def test_gate_measures_on_a_tiny_model_and_caches_per_fingerprint(tiny_runner, tmp_path, monkeypatch):
    config = EngineConfig(default_ratio=1.0, kv_format="fp32")
    first = run_gate(tiny_runner, config, tmp_path)
    assert not first.cached and first.probes == len(selfcheck.PROBES)
    # ratio 1.0 on an exact store: blend is full prefill, full reuse is not
    assert first.kl_blend < 1e-6 and first.top1_blend == 1.0
    assert first.kl_full_reuse > 100 * max(first.kl_blend, 1e-9) and math.isfinite(first.kl_full_reuse)
    assert first.probes_long == len(selfcheck.LONG_PROBES)  # and the long-passage probe, alike
    assert first.kl_blend_long < 1e-6 and first.top1_blend_long == 1.0
    assert first.kl_full_reuse_long > 100 * max(first.kl_blend_long, 1e-9) and math.isfinite(first.kl_full_reuse_long)
    assert first.passed
    assert cache_path(tmp_path, gate_key(tiny_runner, config)).is_file()

    monkeypatch.setattr(selfcheck, "measure_steps", _no_measure)
    again = run_gate(tiny_runner, config, tmp_path)
    assert again.cached and dataclasses.replace(again, cached=False) == first
    # another ratio is another measurement (its own cache file)
    with pytest.raises(AssertionError, match="measured"):
        run_gate(tiny_runner, dataclasses.replace(config, default_ratio=0.5), tmp_path)


@pytest.mark.slow
def test_full_reuse_of_the_real_model_diverges_and_blend_repairs(real_runner):
    """The calibration behind the threshold: SmolLM2 at the default ratio (0.15) passes clearly."""
    result = selfcheck.measure(real_runner, EngineConfig())
    assert result.kl_full_reuse > 0.05
    assert result.kl_blend <= selfcheck.MAX_KL_FRACTION * result.kl_full_reuse
    assert result.kl_full_reuse_long > 0.01  # fewer, longer passages: less for full reuse to miss
    assert result.kl_blend_long <= selfcheck.MAX_KL_FRACTION * result.kl_full_reuse_long
    assert result.passed


def test_long_probe_passages_are_long_and_the_answer_is_never_in_the_first():
    for (passages, question), answer in zip(selfcheck.load_long_probe(), ("Croydon", "Ballater")):
        assert len(passages) >= 2 and max(len(p.split()) for p in passages) >= 300, question
        assert answer not in passages[0] and any(answer in p for p in passages[1:])


def test_a_failed_long_probe_fails_the_gate_though_the_short_one_passes(tiny_runner, monkeypatch):
    from blend_engine.types import Mode

    good = selfcheck.ProbeMeans({Mode.BLEND: (0.01, 1.0), Mode.FULL_REUSE: (0.2, 0.5)})  # 0.05x: passes
    bad = selfcheck.ProbeMeans({Mode.BLEND: (0.05, 0.5), Mode.FULL_REUSE: (0.1, 0.5)})  # 0.5x: fails
    calls = iter([good, bad])
    def means(*_a):  # a stepped job (`background.Steps`) of no units
        return next(calls)
        yield

    monkeypatch.setattr(selfcheck, "_probe_means", means)
    result = selfcheck.measure(tiny_runner, EngineConfig(kv_format="fp32"), probe=[], long_probe=[(("x",), "q")])
    assert not result.passed and result.kl_blend_long == 0.05 and result.kl_blend == 0.01
    assert "long passages KL 0.0500" in GateDecision("enforce", result).reason


def test_a_corrupt_cache_file_is_measured_again(tiny_runner, tmp_path):
    config = EngineConfig(default_ratio=1.0, kv_format="fp32")
    path = cache_path(tmp_path, gate_key(tiny_runner, config))
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert not run_gate(tiny_runner, config, tmp_path).cached
    assert json.loads(path.read_text())["probes"] == len(selfcheck.PROBES)


def _bad_result(runner, config, probe=None, long_probe=None):
    """`selfcheck.measure_steps`' stand-in: a stepped job of no units returning a failed result."""
    return GateResult(kl_blend=0.4, kl_full_reuse=0.5, top1_blend=0.5, top1_full_reuse=0.5,
                      ratio=config.default_ratio, max_kl_fraction=0.25, passed=False, seconds=0.1, probes=3,
                      key=gate_key(runner, config))
    yield


def test_decision_modes():
    bad = GateResult(0.4, 0.5, 0.5, 0.5, 0.15, 0.25, False, 0.1, 3, "k")
    assert GateDecision("enforce", bad).fallback and "fidelity gate" in GateDecision("enforce", bad).reason
    assert not GateDecision("warn", bad).fallback and GateDecision("warn", bad).reason is None
    assert not GateDecision("enforce", dataclasses.replace(bad, passed=True)).fallback
    assert not GateDecision("off", None).fallback
    with pytest.raises(ValueError, match="enforce, warn, off"):
        decide("strict", None, EngineConfig(), None)


# a fixed ratio: once its passages are cached, the controller may serve a tiny prompt by full prefill
QUERY = {"question": "Which river flows through Cairo?", "mode": "blend", "max_tokens": 2, "recompute_ratio": 0.15,
         "documents": [{"title": "Nile", "text": "The Nile flows through Cairo into the Mediterranean Sea."},
                       {"title": "Seine", "text": "The Seine flows through Paris."}]}


def gate_decided(client) -> dict:
    """/readyz once the start-up gate has published its decision (the service is ready before it)."""
    return poll(lambda: (ready := wait_ready(client))["fidelity"] is not None and ready)


def test_failed_gate_makes_blend_answer_with_full_prefill_and_says_so(tmp_path, tiny_stack_factory, monkeypatch):
    monkeypatch.setattr(selfcheck, "measure_steps", _bad_result)
    data_dir = tmp_path / "data"
    with TestClient(create_app(make_settings(data_dir, fidelity_gate="enforce"), tiny_stack_factory)) as client:
        ready = gate_decided(client)
        assert ready["fidelity"]["fallback"] is True and ready["fidelity"]["result"]["kl_blend"] == 0.4
        body = client.post("/v1/query", json=QUERY).json()
        assert body["mode"] == "full_prefill"
        assert "fidelity gate" in body["stats"]["fallback"]
        assert body["stats"]["recomputed_tokens"] == body["stats"]["context_tokens"]
        other = client.post("/v1/query", json={**QUERY, "mode": "full_reuse"}).json()
        assert other["mode"] == "full_reuse" and other["stats"]["fallback"] is None
        metrics = client.get("/metrics").text
        assert "blendserve_blend_fallbacks_total 1.0" in metrics
        assert "blendserve_fidelity_gate_passed 0.0" in metrics
        assert 'blendserve_fidelity_kl{mode="full_reuse"} 0.5' in metrics

    # a restart reads the cached (bad) result instead of measuring; warn serves blend anyway
    monkeypatch.setattr(selfcheck, "measure_steps", _no_measure)
    with TestClient(create_app(make_settings(data_dir, fidelity_gate="warn"), tiny_stack_factory)) as client:
        ready = gate_decided(client)
        assert ready["fidelity"]["result"]["cached"] is True and ready["fidelity"]["fallback"] is False
        body = client.post("/v1/query", json=QUERY).json()
        assert body["mode"] == "blend" and body["stats"]["fallback"] is None
        assert "blendserve_blend_fallback_active 0.0" in client.get("/metrics").text


def test_gate_off_reports_not_run(tmp_path, tiny_stack_factory, monkeypatch):
    monkeypatch.setattr(selfcheck, "measure_steps", _no_measure)
    with TestClient(create_app(make_settings(tmp_path / "data", fidelity_gate="off"), tiny_stack_factory)) as client:
        assert wait_ready(client)["fidelity"] == {"gate": "off", "fallback": False, "reason": None, "error": None,
                                                   "result": None}
        assert "blendserve_fidelity_gate_passed -1.0" in client.get("/metrics").text


def test_command_line(tiny_runner, tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny_runner.model.save_pretrained(folder)
    tiny_runner.tokenizer.save_pretrained(folder)
    args = ["--model", str(folder), "--ratio", "1.0", "--kv-format", "fp32", "--data-dir", str(tmp_path / "d")]
    assert selfcheck.main(args) == 0
    out = capsys.readouterr().out
    assert json.loads(out.splitlines()[0])["passed"] is True and "fidelity gate passed" in out
    assert selfcheck.main(args) == 0 and '"cached": true' in capsys.readouterr().out
    assert selfcheck.main([*args, "--ratio", "2"]) == 2
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert selfcheck.main(args) == 2
    assert "RoPE type 'dynamic'" in capsys.readouterr().err


# ---------------------------------------------------------------- judged by the compute dtype (issue #39)
def test_a_near_tie_flipped_in_bf16_counts_as_agreement_though_the_logits_are_fp32():
    """The engine's logits are fp32 tensors computed in bf16: the tie is judged by bf16's resolution
    (an fp32 epsilon on them, the old rule, called this flip a disagreement)."""
    from blend_engine.selfcheck import compare, tolerance

    ref = torch.tensor([0.0, 30.0, 29.875, 5.0])  # fp32 storage; a 0.125 gap is ~half a bf16 step at 30
    flipped = torch.tensor([0.0, 29.875, 30.0, 5.0])
    got = compare(ref, flipped, torch.bfloat16)
    assert got.near_tie and not got.same_top1 and got.top1_agrees
    old_rule_tol = 2 * torch.finfo(ref.dtype).eps * 30.0
    assert 0.125 > old_rule_tol  # what the old check would have refused
    assert not compare(ref, flipped, torch.float32).top1_agrees  # in fp32 the same flip is a real disagreement
    far = torch.tensor([0.0, 30.0, 27.0, 5.0])
    assert not compare(far, torch.tensor([0.0, 27.0, 30.0, 5.0]), torch.bfloat16).top1_agrees
    assert tolerance(torch.bfloat16).kl > tolerance(torch.float16).kl > tolerance(torch.float32).kl
    with pytest.raises(ValueError, match="no fidelity tolerance"):
        tolerance(torch.int8)


def test_kl_within_the_dtype_tolerance_passes_and_beyond_fails():
    from blend_engine.selfcheck import compare, tolerance

    ref = torch.zeros(50)
    ref[3] = 8.0
    tol = tolerance(torch.bfloat16).kl
    small, large = ref.clone(), ref.clone()
    small[3] = 7.99
    large[3] = 5.0  # the top token's probability drops a lot: far beyond bf16 rounding
    assert compare(ref, small, torch.bfloat16).kl < tol and compare(ref, small, torch.bfloat16).passed
    assert compare(ref, large, torch.bfloat16).kl > tol and not compare(ref, large, torch.bfloat16).passed


@pytest.fixture(scope="module")
def bf16_runner(real_runner):
    """The tiny random Llama in bf16 on the CPU: what a GPU computes in, on CI."""
    import torch as _torch

    from blend_engine.model.runner import ModelRunner
    from tests.helpers import tiny_model

    return ModelRunner(tiny_model().to(_torch.bfloat16), real_runner.tokenizer, "tiny-bf16")


def test_the_gate_in_bf16_judges_blend_against_its_own_kernels_and_passes_a_correct_engine(bf16_runner):
    """bf16 on the CPU: full prefill and blend@1.0 differ by rounding only (within bf16's tolerance),
    blend at ratio 1.0 equals its reference exactly, and the gate passes."""
    import torch as _torch

    assert bf16_runner.dtype == _torch.bfloat16
    result = selfcheck.measure(bf16_runner, EngineConfig(default_ratio=1.0, kv_format="bf16"))
    assert result.dtype == "bfloat16" and result.kernels_agree
    assert 0.0 <= result.kl_kernels <= selfcheck.tolerance(_torch.bfloat16).kl
    assert result.kl_blend == 0.0 and result.top1_blend == 1.0 and result.kl_blend_long == 0.0
    assert result.kl_full_reuse > 0 and result.passed


def test_an_engine_whose_blend_path_is_wrong_fails_the_gate_whatever_the_ratio(bf16_runner, monkeypatch):
    """A blend path that disagrees with full prefill beyond rounding is an engine fault: the gate fails
    and says so, even though blend against its own reference looks perfect."""

    from blend_engine.types import Mode

    real = selfcheck._logits

    def broken(engine, passages, question, mode, ratio=None):  # a stepped job, as `_logits`
        out = yield from real(engine, passages, question, mode, ratio)
        return out.roll(1) if mode is Mode.BLEND else out  # a wrong blend path, the same at every ratio

    monkeypatch.setattr(selfcheck, "_logits", broken)
    result = selfcheck.measure(bf16_runner, EngineConfig(default_ratio=1.0, kv_format="bf16"))
    assert not result.kernels_agree and not result.passed  # the rolled logits pick another token
    assert result.kl_kernels > 0 and result.kl_blend == 0.0  # blend against its own (wrong) reference looks exact
    assert "engine fault" in GateDecision("enforce", result).reason
