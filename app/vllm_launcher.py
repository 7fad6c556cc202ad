"""`python -m app.vllm_launcher` (what `make run-vllm` runs): a stock vLLM server with Blendserve's KV
connector, and Blendserve in front of it with `BLENDSERVE_DECODER_KIND=vllm`.

    client -> Blendserve (BLENDSERVE_SERVICE_HOST:PORT): retrieve, blend, hand the KV over in /dev/shm
                  \\-> vLLM (127.0.0.1:BLENDSERVE_VLLM_PORT, default 8001, from .venv-vllm): decode

Blendserve reads its usual settings (BLENDSERVE_HOST, BLENDSERVE_PORT, BLENDSERVE_DATA_DIR, ...);
the launcher only adds the decoder's. vLLM serves the same model (a GGUF is written out once as a
Hugging Face folder: `blend_engine.model.hf_folder`) in the same dtype. /readyz is ready once both are.
Stopping the launcher (Ctrl-C, SIGTERM) stops vLLM too. Variables of the launcher alone:

    BLENDSERVE_VLLM_PORT (8001), BLENDSERVE_VLLM_VENV (.venv-vllm), BLENDSERVE_VLLM_CORES (all of this
    machine's, as vLLM's VLLM_CPU_OMP_THREADS_BIND), BLENDSERVE_VLLM_KV_GB (4: VLLM_CPU_KVCACHE_SPACE)
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVED_NAME = "blendserve-model"
BESIDE_VLLM = {"OMP_WAIT_POLICY": "PASSIVE",  # Blendserve's OpenMP beside vLLM on shared cores (`beside_vllm`)
               "BLENDSERVE_ENGINE_KV_POOL_PREFAULT": "true"}  # its KV pool resident from the start, as vLLM's
logger = logging.getLogger("app.vllm_launcher")


def connector_config(segment_dir: Path, redis_url: str | None = None) -> dict:
    """The `--kv-transfer-config` that loads `blendserve_vllm.connector` (docs/deployment.md); with
    `redis_url` it also loads `redis:` handles from that Redis."""
    extra: dict = {"segment_dir": str(segment_dir)}
    if redis_url:
        extra["redis_url"] = redis_url
    return {"kv_connector": "BlendserveConnector", "kv_connector_module_path": "blendserve_vllm.connector",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def vllm_command(python: Path, model_dir: Path, port: int, dtype: str, segment_dir: Path,
                 max_model_len: int = 8192, host: str = "127.0.0.1", redis_url: str | None = None) -> list[str]:
    """vLLM's own OpenAI-compatible server with the connector, prefix caching and cached-token counts."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--max-logprobs", "20", "--generation-config", "vllm",
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
            "--kv-transfer-config", json.dumps(connector_config(segment_dir, redis_url))]


def cpu_list(spec: str) -> list[int]:
    """Cores in VLLM_CPU_OMP_THREADS_BIND's form ("0-3", "0,2,4-5") as a list."""
    cores: list[int] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    if not cores:
        raise ValueError(f"no cores in {spec!r}")
    return cores


def vllm_env(base: dict[str, str], venv: Path, cores: str, kv_gb: int) -> dict[str, str]:
    """vLLM's CPU build's environment: bound cores, KV space, its OpenMP preloaded, the connector importable,
    and its model run inside the engine-core process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).

    Why in-process: with the default multiprocessing executor the worker process reads the engine's
    shared-memory queue spinning (`sched_yield`) for a second after every step, so for a second after
    each answer it holds a core that Blendserve's blend needs: on 2 shared cores a 3-passage blend took
    1,050 ms of recompute right after a vLLM answer against 150 ms after a pause (`top -H`: the worker at
    100% with nothing to decode). In-process there is no queue to spin on and the engine core blocks
    while idle. vLLM sets the OpenMP variables itself only for its worker processes, so they are set
    here as it sets them (threads, a 5 ms block time, no TPAUSE), all but KMP_AFFINITY: vLLM binds its
    OpenMP threads to the cores itself, and with the variable too a 2,252-token prompt's prefill took
    4.7 s instead of 2.3 s. Without it vLLM alone serves as fast as with its worker processes (prefill
    2.3 s both ways, 64 tokens after it 4.9 s against 5.1 s)."""
    env = {k: v for k, v in base.items() if not k.startswith(("VLLM_", "BLENDSERVE_"))}
    env.update({"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
                "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "OMP_NUM_THREADS": str(len(cpu_list(cores))),
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH", "")) if p)})
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
        env.update({"KMP_BLOCKTIME": "5", "KMP_TPAUSE": "0"})
    return env


def beside_vllm(base: dict[str, str]) -> dict[str, str]:
    """What Blendserve's environment gains beside vLLM on the same cores (`BESIDE_VLLM`, where `base`
    does not set it already): its OpenMP threads sleep as soon as they wait (`OMP_WAIT_POLICY=PASSIVE`)
    instead of spinning at each op's barrier on a core vLLM's threads need. Two spinning teams on 2
    shared cores slowed each other ~10x: 8 clients' blends of new passage combinations took p50 9.4 s
    (recompute 2.0 s) and the pair gave 13.7 tokens/s; passive, 3.7 s (recompute 0.45 s) and 32.6
    tokens/s, repeated prompts unchanged (57.3 against 57.9 tokens/s). vLLM keeps its 5 ms block time:
    at 0 its decode slowed (36.7 tokens/s on repeated prompts). And its KV pool is written once at
    start-up (`BLENDSERVE_ENGINE_KV_POOL_PREFAULT`), as vLLM's KV space is: beside vLLM's resident memory,
    on a VM that backs memory lazily, a burst of 8 blends took 4.0-5.5 s faulting pool pages in, 3.2-3.6 s
    written at start-up (on warm memory the same either way)."""
    return {k: v for k, v in BESIDE_VLLM.items() if k not in base}


def vllm_dtype(dtype: str) -> str:
    """Blendserve's `BLENDSERVE_MODEL_DTYPE` as vLLM's --dtype (auto: float32 on the CPU, as Blendserve)."""
    return "float32" if dtype == "auto" else dtype


def start_vllm(settings, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start vLLM for `settings`' model; its process (own session) and base URL."""
    from blend_engine.model.hf_folder import vllm_folder

    venv = Path(env.get("BLENDSERVE_VLLM_VENV", REPO / ".venv-vllm"))
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM environment at {venv}: run `make run-vllm` (it installs vLLM's CPU build there)")
    port = int(env.get("BLENDSERVE_VLLM_PORT", "8001"))
    model_dir = vllm_folder(settings.model.name, settings.model.cache_dir)
    cmd = vllm_command(python, model_dir, port, vllm_dtype(settings.model.dtype), settings.decoder.segment_dir)
    cores = env.get("BLENDSERVE_VLLM_CORES", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
    log_path = settings.data_dir / "vllm.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("starting vLLM on 127.0.0.1:%d (model %s; log %s)", port, model_dir, log_path)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=vllm_env(env, venv, cores, int(env.get("BLENDSERVE_VLLM_KV_GB", "4"))),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to vLLM's process group (its engine runs in child processes), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from app.settings import ServiceSettings

    env = dict(os.environ)
    settings = ServiceSettings()  # fails fast on a bad value, before anything starts
    proc, url = start_vllm(settings, env)
    env.update({"BLENDSERVE_DECODER_KIND": "vllm", "BLENDSERVE_DECODER_VLLM_URL": url,
                "BLENDSERVE_DECODER_VLLM_MODEL": SERVED_NAME})
    try:
        return subprocess.call([sys.executable, "-m", "app"], cwd=REPO, env=env | beside_vllm(env))
    except KeyboardInterrupt:
        return 130
    finally:
        stop(proc)


if __name__ == "__main__":
    raise SystemExit(main())
