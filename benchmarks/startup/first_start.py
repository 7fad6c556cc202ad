"""`python -m benchmarks.startup.first_start [--cold]`: how soon a fresh clone's `make run` answers.

Clones this repository's committed HEAD (or `--ref`) into a temporary folder, links the existing
virtual environment into it (the install is not what is measured: the clock starts with the model
package installed, as after `make install`), and runs `make run` there (with `-o .venv/.installed`,
so make does not reinstall) on a free port, with a fresh data dir; `--cold` also points the model
cache (BLENDSERVE_MODEL_CACHE_DIR) at an empty folder, so the GGUF is prepared as on a fresh
machine. From the moment the port opens it asks a question every second until one is answered,
and prints the time to port, ready, first 200 answer, blend on and sample done, the count of each
status seen, and every 4xx (the caller blamed) or 5xx other than 503.

Issue #38's targets (2 cores, cold): first answer <= 30 s, blend on <= 60 s, sample done <= 150 s;
warm second start: first answer <= 15 s. Printed, not asserted: timings depend on the machine.
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

from benchmarks.common.service import free_port

ROOT = Path(__file__).resolve().parents[2]
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


def _env(port: int, model_cache: Path | None) -> dict:
    """The service's environment: no BLENDSERVE_* of ours but the listener (and the cold model cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLENDSERVE_")}
    # the release before the settings groups (`--ref`) reads only the flat names; today's takes them too
    env.update({"BLENDSERVE_PORT": str(port), "BLENDSERVE_HOST": "127.0.0.1", "HF_HUB_OFFLINE": "1"})
    if model_cache is not None:
        env["BLENDSERVE_MODEL_CACHE_DIR"] = str(model_cache)
    return env


def _blend_on(ready: dict) -> bool:
    """Blend decided on: `blend.state` (issue #38), or for older trees a ready body whose gate passed."""
    if "blend" in ready:
        return (ready.get("blend") or {}).get("state") == "on"
    fidelity = ready.get("fidelity") or {}
    return bool(ready.get("ready")) and not fidelity.get("fallback", True)


class Timeline:
    """What one first start did, second by second: milestones and every answer's status."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.marks: dict[str, float | None] = dict.fromkeys(
            ("port_s", "page_s", "ready_s", "first_answer_s", "blend_on_s", "sample_done_s"))
        self.statuses: dict[int, int] = {}
        self.bad: list[dict] = []  # 4xx (the caller blamed) and 5xx other than 503, with their message
        self.first_answer: dict | None = None
        self.sample: dict | None = None

    def since(self) -> float:
        return round(time.perf_counter() - self.t0, 2)

    def mark(self, name: str) -> None:
        if self.marks[name] is None:
            self.marks[name] = self.since()

    def answer(self, r: httpx.Response) -> None:
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code == 200 and self.first_answer is None:
            self.mark("first_answer_s")
            self.first_answer = {"answer": body.get("answer"), "mode": body.get("mode"),
                                 "sources": [s.get("title") for s in body.get("sources", [])]}
        elif r.status_code >= 400 and r.status_code != 503:
            self.bad.append({"at_s": self.since(), "status": r.status_code,
                             "message": (body.get("error") or {}).get("message")})


def _tick(http: httpx.Client, url: str, tl: Timeline) -> bool:
    """One second's checks; True once everything measured has happened."""
    if tl.marks["port_s"] is None:
        if http.get(f"{url}/healthz").status_code != 200:
            return False
        tl.mark("port_s")
        if http.get(f"{url}/").status_code == 200:
            tl.mark("page_s")
    if tl.marks["first_answer_s"] is None:
        tl.answer(http.post(f"{url}/v1/query", json={"question": QUESTION, "top_k": 3, "max_tokens": 24}))
    r = http.get(f"{url}/readyz")
    ready = r.json()
    if r.status_code == 200:
        tl.mark("ready_s")
        if _blend_on(ready):
            tl.mark("blend_on_s")
        info = ready.get("ingestion") or {}
        if info.get("status") in ("done", "failed", "cancelled"):
            tl.mark("sample_done_s")
            tl.sample = info
    return all(v is not None for k, v in tl.marks.items() if k != "page_s")


def measure(clone: Path, port: int, timeout: float, model_cache: Path | None) -> dict:
    """`make run` in the clone, a question every second from the moment the port opens."""
    url = f"http://127.0.0.1:{port}"
    log = (clone / "run.log").open("w")
    tl = Timeline()
    proc = subprocess.Popen(["make", "-o", ".venv/.installed", "run"], cwd=clone, env=_env(port, model_cache),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client(timeout=120) as http:
            while tl.since() < timeout and proc.poll() is None:
                started = time.perf_counter()
                try:
                    if _tick(http, url, tl):
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return {**tl.marks, "statuses": tl.statuses, "caller_blamed_or_5xx": tl.bad, "first_answer": tl.first_answer,
            "sample_final": tl.sample, "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=Path(sys.prefix), help="the virtual environment to link (default: "
                                                                         "this interpreter's)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for every milestone")
    ap.add_argument("--cold", action="store_true", help="an empty model cache too (BLENDSERVE_MODEL_CACHE_DIR in the "
                                                        "temporary folder): nothing prepared, as on a fresh machine")
    ap.add_argument("--ref", default="HEAD", help="the commit to clone (default HEAD; e.g. main, for a before/after)")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its run.log)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="first-start-"))
    clone = tmp / "blendserve"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", args.ref], check=True)
    (clone / ".venv").symlink_to(args.venv.resolve())
    try:
        result = {"commit": subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], check=True,
                                           capture_output=True, text=True).stdout.strip(), "cold": args.cold,
                  **measure(clone, free_port(), args.timeout, tmp / "models" if args.cold else None)}
    finally:
        if not args.keep:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    print(json.dumps(result, indent=1))
    return 0 if result.get("first_answer_s") is not None else 1


if __name__ == "__main__":
    sys.exit(main())
