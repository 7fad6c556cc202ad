"""`python -m benchmarks.first_start`: how soon a fresh clone's `make run` serves the page and answers.

Clones this repository's committed HEAD into a temporary folder, links the existing virtual environment
into it (the install is not what is measured: the clock starts with the model already available
locally, as the bundled SmolLM2 package is), and runs `make run` there (with `-o .venv/.installed`, so
make does not reinstall) on a free port, with a fresh data dir. It records when the service listens
(/healthz), when /readyz turns ready (model loaded, fidelity gate run), when the page is served, when
the first question is answered (while the sample corpus is still being ingested in the background;
passages not yet cached are computed on the spot), and when the sample ingestion job ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.throughput import free_port

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Which country is Lake Tahoe in?"


def wait(fn, timeout: float, step: float = 0.1):
    """Poll fn() until it returns something truthy (its value), or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = fn()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(step)
    return None


def measure(clone: Path, port: int, sample_timeout: float) -> dict:
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "BLENDSERVE_SERVICE_PORT": str(port), "BLENDSERVE_SERVICE_HOST": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    listener = ("BLENDSERVE_SERVICE_PORT", "BLENDSERVE_SERVICE_HOST")
    env = {k: v for k, v in env.items() if not k.startswith("BLENDSERVE_") or k in listener}
    log = (clone / "run.log").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(["make", "-o", ".venv/.installed", "run"], cwd=clone, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    out: dict = {}
    try:
        with httpx.Client(timeout=120) as http:
            def since() -> float:
                return round(time.perf_counter() - t0, 2)

            out["listening_s"] = wait(lambda: http.get(f"{url}/healthz").status_code == 200 and since(), 300)
            out["page_s"] = wait(lambda: http.get(f"{url}/").status_code == 200 and since(), 300)
            out["ready_s"] = wait(lambda: http.get(f"{url}/readyz").status_code == 200 and since(), 600)
            asked = {"question": QUESTION, "top_k": 3, "max_tokens": 24}
            r = http.post(f"{url}/v1/query", json=asked)
            out["first_question"] = {"at_s": since(), "status": r.status_code}  # 400 while nothing is indexed yet
            while r.status_code != 200 and time.perf_counter() - t0 < 600:
                time.sleep(0.5)
                r = http.post(f"{url}/v1/query", json=asked)
            out["first_answer_s"] = since()
            out["first_answer_status"] = r.status_code
            body = r.json()
            out["first_answer"] = body.get("answer") or body.get("error", {}).get("message")
            out["first_answer_passages"] = [p["title"] for p in body.get("passages", [])]
            ingestion = http.get(f"{url}/readyz").json().get("ingestion") or {}
            out["sample_at_first_answer"] = {k: ingestion.get(k) for k in ("status", "processed", "documents")}

            def sample_done():
                info = http.get(f"{url}/readyz").json().get("ingestion") or {}
                return info.get("status") in ("done", "failed", "cancelled") and (since(), info)

            done = wait(sample_done, sample_timeout, step=1.0)
            out["sample_done_s"], out["sample_final"] = (done[0], done[1]) if done else (None, None)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    out["load_average"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=Path(sys.prefix), help="the virtual environment to link (default: "
                                                                         "this interpreter's)")
    ap.add_argument("--sample-timeout", type=float, default=900, help="seconds to wait for the sample ingestion")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its run.log)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="first-start-"))
    clone = tmp / "blendserve"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    (clone / ".venv").symlink_to(args.venv.resolve())
    try:
        result = {"commit": subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], check=True,
                                           capture_output=True, text=True).stdout.strip(),
                  **measure(clone, free_port(), args.sample_timeout)}
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    print(json.dumps(result, indent=1))
    return 0 if result.get("first_answer_status") == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
