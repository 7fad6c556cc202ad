"""The docker-compose topology as real processes on loopback ports: PostgreSQL (initdb + pg_ctl),
redis-server, two API processes (`python -m app`, a tiny random model) and haproxy running the
compose file's own docker/haproxy.cfg.

1. A document ingested through replica A is answered by replica B through the balancer within
   the sync lag bound, and B's KV came from Redis (A prefilled it; B computed nothing).
2. Replica A is SIGKILLed under concurrent requests: every request sent after the kill is
   answered by B; at most the requests in flight at the kill fail.
3. While A is down, B ingests and deletes and the CLI ingests into the same store (B answers from
   it); A restarts and catches up from the change log; a delete made through A disappears from
   B's answers.

Measured numbers are logged (run with `-s -o log_cli=true --log-cli-level=INFO` to see them).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.helpers import FIXED_RATIO_ENV
from tests.local_services import RedisProcess, free_port, pg_bin_dir, wait_for

logger = logging.getLogger("topology")
ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "docker" / "haproxy.cfg"
SYNC_LAG_BOUND_S = 2.0

_missing = [name for name, ok in (("postgresql", pg_bin_dir() is not None),
                                  ("redis-server", shutil.which("redis-server") is not None),
                                  ("haproxy", shutil.which("haproxy") is not None)) if not ok]
pytestmark = [
    pytest.mark.topology,
    pytest.mark.skipif(bool(_missing), reason=f"topology test skipped: {', '.join(_missing)} not installed "
                                              f"(apt-get install {' '.join(_missing)}; .ci/run does)"),
]

LIGHTHOUSE = {"doc_id": "topo-lighthouse", "title": "Quillon lighthouse",
              "text": "The Quillon lighthouse was painted teal in 1931 by Mirela Vantongeren."}
ORCHARD = {"doc_id": "topo-orchard", "title": "Brannock orchard",
           "text": "The Brannock orchard grows the yellow Severin pear, first planted in 1877."}
FERRY = {"doc_id": "topo-ferry", "title": "Dunmarrow ferry",
         "text": "The Dunmarrow ferry crosses the estuary nine times a day, every day of the year."}


@dataclass
class Api:
    name: str
    port: int
    data_dir: Path
    env: dict
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "app"], env=self.env, cwd=self.data_dir.parent,
                                         stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_for(ready, timeout, 0.2):
            raise RuntimeError(f"{self.name} not ready after {timeout} s:\n{self.tail()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def readyz(self) -> dict:
        return httpx.get(f"{self.url}/readyz", timeout=5).json()

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        m = re.search(rf"^{re.escape(name)}(?:_total)?{re.escape(labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@dataclass
class Topology:
    lb_url: str
    a: Api
    b: Api
    procs: list = field(default_factory=list)


@pytest.fixture(scope="module")
def topology(tmp_path_factory, tiny_model_dir, pg_cluster):
    work = tmp_path_factory.mktemp("topology")
    redis_proc = haproxy = None
    apis: list[Api] = []
    try:
        db_url = pg_cluster.create_database("topology")
        redis_proc = RedisProcess().start()
        base = {k: v for k, v in os.environ.items() if not k.startswith("BLENDSERVE_")}
        base.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                    BLENDSERVE_SERVICE_HOST="127.0.0.1", BLENDSERVE_STORE_DATABASE_URL=db_url,
                    BLENDSERVE_STORE_REDIS_URL=redis_proc.url,
                    BLENDSERVE_MODEL_NAME=str(tiny_model_dir), BLENDSERVE_MODEL_DEVICE="cpu", BLENDSERVE_SERVICE_WORKERS="1",
                    BLENDSERVE_INGEST_SAMPLE_ON_START="false", BLENDSERVE_INGEST_CHUNK_TOKENS="64",
                    BLENDSERVE_SERVICE_LOG_LEVEL="info", **FIXED_RATIO_ENV,
                    BLENDSERVE_ENGINE_FIDELITY_GATE="off")  # a random tiny model: blend is tested, not gated
        for name in ("api-1", "api-2"):
            folder = work / name
            (folder / "data").mkdir(parents=True)
            port = free_port()
            env = {**base, "BLENDSERVE_SERVICE_PORT": str(port), "BLENDSERVE_DATA_DIR": str(folder / "data")}
            apis.append(Api(name, port, folder / "data", env, folder / "log.txt"))
        for api in apis:
            api.start()
        lb_port = free_port()
        lb_env = {**base, "BLENDSERVE_LB_BIND": f"127.0.0.1:{lb_port}",
                  "BLENDSERVE_API_1": f"127.0.0.1:{apis[0].port}", "BLENDSERVE_API_2": f"127.0.0.1:{apis[1].port}"}
        with open(work / "haproxy.log", "wb") as out:
            haproxy = subprocess.Popen(["haproxy", "-db", "-f", str(HAPROXY_CFG)], env=lb_env, cwd=work,
                                       stdout=out, stderr=subprocess.STDOUT)
        for api in apis:
            api.wait_ready()
        lb = f"http://127.0.0.1:{lb_port}"

        def both_up() -> bool:  # the balancer's health checks have seen both replicas ready
            servers = set()
            for _ in range(4):
                try:
                    servers.add(httpx.get(f"{lb}/readyz", timeout=2).headers.get("x-blendserve-server"))
                except httpx.HTTPError:
                    return False
            return servers == {"api-1", "api-2"}

        assert wait_for(both_up, 20, 0.2), f"haproxy never routed to both replicas:\n{(work / 'haproxy.log').read_text()}"
        yield Topology(lb, apis[0], apis[1])
    finally:  # the balancer first: its idle keep-alive connections would hold up the replicas' shutdown
        if haproxy is not None:
            haproxy.terminate()
            haproxy.wait(10)
        for api in apis:
            if api.proc is not None and api.proc.poll() is None:
                api.proc.terminate()
        for api in apis:
            api.stop()
        if redis_proc is not None:
            redis_proc.stop()


def _ask(client: httpx.Client, url: str, question: str, top_k: int = 1) -> httpx.Response:
    return client.post(f"{url}/v1/query", json={"question": question, "top_k": top_k, "max_tokens": 1,
                                                "mode": "blend"}, timeout=30)


def _titles(resp: httpx.Response) -> list[str]:
    return [p["title"] for p in resp.json()["passages"]] if resp.status_code == 200 else []


def test_two_replicas_share_one_store_fail_over_and_catch_up(topology):
    a, b, lb = topology.a, topology.b, topology.lb_url
    client = httpx.Client()

    # -- 1. ingest through A; B answers from it through the balancer, its KV from Redis
    redis_hits_before = b.metric("blendserve_kv_store_hits", '{tier="redis"}')
    r = client.post(f"{a.url}/v1/documents", json={"documents": [LIGHTHOUSE]}, timeout=60)
    assert r.status_code == 201 and r.json()["new_passages"] == 1, r.text
    t_ingested = time.monotonic()
    head = a.readyz()["sync"]["head"]
    synced = wait_for(lambda: b.readyz()["sync"]["generation"] >= head and time.monotonic(), 10, 0.02)
    assert synced, f"B never applied change {head}: {b.readyz()['sync']}"
    sync_lag = synced - t_ingested
    assert sync_lag <= SYNC_LAG_BOUND_S, f"B's index lagged {sync_lag:.2f} s behind A's ingestion"

    def b_answers():
        resp = _ask(client, lb, "Who painted the Quillon lighthouse?")
        return resp if resp.headers.get("x-blendserve-server") == "api-2" and resp.status_code == 200 else None

    answer = wait_for(b_answers, 15, 0.0)
    answer_lag = time.monotonic() - t_ingested
    assert answer is not None, "the balancer never routed a query to B"
    assert _titles(answer) == [LIGHTHOUSE["title"]]
    stats = answer.json()["stats"]
    assert stats["cache_misses"] == 0 and stats["cache_hits"] >= 1, stats  # B prefilled nothing itself
    assert b.metric("blendserve_kv_store_hits", '{tier="redis"}') >= redis_hits_before + 2  # system prefix + passage
    logger.info("sync lag: B's index had A's document %.3f s after A's ingestion returned; B answered from it "
                "through the balancer after %.3f s", sync_lag, answer_lag)

    # -- 2. kill A under concurrent requests: new requests go to B, only in-flight ones may fail
    results: list[tuple[float, int | str, str | None]] = []  # (sent at, status or error, server)
    stop = threading.Event()

    def load():
        with httpx.Client() as c:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    resp = _ask(c, lb, "Who painted the Quillon lighthouse?")
                    results.append((sent, resp.status_code, resp.headers.get("x-blendserve-server")))
                except httpx.HTTPError as exc:
                    results.append((sent, type(exc).__name__, None))

    clients = [threading.Thread(target=load) for _ in range(4)]
    for t in clients:
        t.start()
    time.sleep(1.5)
    killed_at = time.monotonic()
    a.kill()
    time.sleep(3.0)
    stop.set()
    for t in clients:
        t.join(60)
    failed = [x for x in results if x[1] != 200]
    after = [x for x in results if x[0] > killed_at + 0.05]
    logger.info("failover: %d requests sent through the balancer by 4 clients, %d failed (%d sent after the "
                "kill, all answered by %s)", len(results), len(failed), len(after), sorted({str(x[2]) for x in after}))
    logger.info("failures: %s", [(round(x[0] - killed_at, 3), x[1], x[2]) for x in failed])
    assert len(failed) <= len(clients), f"more failures than requests in flight: {failed}"
    assert after and all(x[1] == 200 and x[2] == "api-2" for x in after), [x for x in after if x[1] != 200][:5]
    assert any(x[2] == "api-1" for x in results if x[0] < killed_at), "A got no traffic before the kill"

    # -- 3. while A is down: B ingests and deletes, the CLI ingests into the same store; A restarts
    #       and catches up from the change log
    r = client.post(f"{lb}/v1/documents", json={"documents": [ORCHARD]}, timeout=60)
    assert r.status_code == 201 and r.json()["new_passages"] == 1, r.text
    assert client.delete(f"{lb}/v1/documents/{LIGHTHOUSE['doc_id']}", timeout=30).status_code == 204
    cli_dir = a.data_dir.parent.parent / "cli"
    (cli_dir / "data").mkdir(parents=True)
    (cli_dir / "ferry.jsonl").write_text(json.dumps(FERRY) + "\n")
    cli = subprocess.run([sys.executable, "-m", "corpus_tools", "ingest", str(cli_dir / "ferry.jsonl")],
                         env={**a.env, "BLENDSERVE_DATA_DIR": str(cli_dir / "data")}, cwd=cli_dir,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr[-2000:]
    t_cli = time.monotonic()
    ferry = wait_for(lambda: FERRY["title"] in _titles(_ask(client, b.url, "How often does the Dunmarrow ferry cross?")),
                     10, 0.05)
    assert ferry, "B never answered from the document the CLI ingested"
    logger.info("a CLI ingestion was answered by B %.3f s after the CLI exited", time.monotonic() - t_cli)
    a.start()
    a.wait_ready()
    start = a.readyz()["sync"]["start"]
    assert start["loaded"] and start["caught_up"] >= 3 and (start["added"], start["removed"]) == (0, 0), start
    r = _ask(client, a.url, "Which pear grows in the Brannock orchard?", top_k=5)
    assert r.status_code == 200 and ORCHARD["title"] in _titles(r) and LIGHTHOUSE["title"] not in _titles(r), r.text

    # -- a delete through A leaves B's answers
    t_deleted = time.monotonic()
    assert client.delete(f"{a.url}/v1/documents/{ORCHARD['doc_id']}", timeout=30).status_code == 204
    gone = wait_for(lambda: ORCHARD["title"] not in _titles(_ask(client, b.url, "Brannock orchard pear", 5)), 10, 0.05)
    assert gone, "B still answers from a document deleted through A"
    logger.info("delete through A left B's answers after %.3f s; A caught up %d changes from the log at restart",
                time.monotonic() - t_deleted, start["caught_up"])
    client.close()
