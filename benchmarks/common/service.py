"""The running service, for the benchmarks that talk to it over HTTP (and the tests): a free local port,
`python -m app` started from the repository and stopped again, and the wait for its /readyz."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def app_process(env: dict[str, str], log_path: Path, ready_timeout_s: float) -> Iterator[str]:
    """`python -m app` from the repository with `env` (its port in BLENDSERVE_SERVICE_PORT), its output
    appended to `log_path`; yields its base URL once /readyz answers 200, stops it on the way out."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{env['BLENDSERVE_SERVICE_PORT']}"
            wait_ready(url, ready_timeout_s, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None = None, headers: dict | None = None,
               interval_s: float = 1.0, request_timeout_s: float = 5.0) -> dict:
    """Poll `GET {url}/readyz` until it answers 200; its JSON. RuntimeError as soon as `proc` (the
    service's process, when given) exits; TimeoutError, with the last answer, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the service exited with {proc.returncode} before it was ready")
        try:
            r = httpx.get(f"{url}/readyz", headers=headers, timeout=request_timeout_s)
            if r.status_code == 200:
                return r.json()
            last = f"{r.status_code} {r.text[:500]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(interval_s)
    raise TimeoutError(f"the service at {url} was not ready within {timeout_s:.0f} s (last: {last})")
