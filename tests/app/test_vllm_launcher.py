"""The environment `make run-vllm` (and the peer benchmark's pair) gives the vLLM server."""

from pathlib import Path

import pytest

from app.vllm_launcher import REPO, beside_vllm, cpu_list, vllm_env


def test_cpu_list_reads_vllm_bind_syntax():
    assert cpu_list("0-1") == [0, 1]
    assert cpu_list("0,2,4-6") == [0, 2, 4, 5, 6]
    assert cpu_list("3") == [3]
    with pytest.raises(ValueError, match="no cores"):
        cpu_list(" , ")


def test_model_runs_in_the_engine_core_process_with_vllms_openmp_settings(tmp_path: Path):
    """No worker process spinning on the engine's queue after each step; the OpenMP variables vLLM
    would set in its worker are set here instead, for the bound cores."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    env = vllm_env({"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "40", "BLENDSERVE_PORT": "1"}, tmp_path, "0,2-3", 4)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == "3"
    assert "KMP_AFFINITY" not in env  # vLLM binds its threads itself; the variable too halved its speed
    assert (env["KMP_BLOCKTIME"], env["KMP_TPAUSE"]) == ("5", "0")
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"  # the caller's own VLLM_ and BLENDSERVE_ variables do not leak
    assert "BLENDSERVE_PORT" not in env
    assert env["PYTHONPATH"].split(":")[0] == str(REPO)


def test_without_intel_openmp_no_kmp_variables(tmp_path: Path):
    env = vllm_env({"PATH": "/bin"}, tmp_path, "0-1", 2)
    assert "LD_PRELOAD" not in env and not any(k.startswith("KMP_") for k in env)
    assert env["OMP_NUM_THREADS"] == "2"


def test_blendserve_beside_vllm_waits_passively_unless_told_otherwise():
    base = {"PATH": "/bin"}
    assert (base | beside_vllm(base))["OMP_WAIT_POLICY"] == "PASSIVE"
    own = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert (own | beside_vllm(own))["OMP_WAIT_POLICY"] == "ACTIVE"


def test_blendserve_beside_vllm_holds_its_kv_pool_from_the_start_unless_told_otherwise():
    base = {"PATH": "/bin"}
    assert (base | beside_vllm(base))["BLENDSERVE_ENGINE_KV_POOL_PREFAULT"] == "true"
    own = {"BLENDSERVE_ENGINE_KV_POOL_PREFAULT": "false"}
    assert (own | beside_vllm(own))["BLENDSERVE_ENGINE_KV_POOL_PREFAULT"] == "false"
