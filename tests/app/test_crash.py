"""SIGKILL during ingestion, through the CLI and through the REST API, at several points. After a
restart every document is whole or absent (never some of its passages), `verify` names the ones
left incomplete, and re-running the ingestion completes them. Tiny random model, real processes."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from corpus_cli.cli import main
from tests.helpers import FIXED_RATIO_ENV, ROOT
from tests.local_services import wait_url_ready

N_DOCS = 8


def corpus_docs() -> list[dict]:
    """Documents of several passages each (at 32-token passages and 2-passage batches, each spans batches)."""
    return [{"doc_id": f"doc{i}", "title": f"Topic {i}",
             "text": " ".join(f"Fact {j} about topic {i} is that item {i}-{j} weighs {j + i} kilograms."
                              for j in range(10))}
            for i in range(N_DOCS)]


@pytest.fixture
def env(tiny_model_dir, tmp_path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "BLENDSERVE_MODEL_NAME": str(tiny_model_dir), "BLENDSERVE_DATA_DIR": str(tmp_path / "data"),
            "BLENDSERVE_INGEST_BATCH_SIZE": "2", "BLENDSERVE_INGEST_CHUNK_TOKENS": "32",
            "BLENDSERVE_STORE_MEMORY_CACHE_MB": "64", "BLENDSERVE_STORE_DISK_CACHE_MB": "256",
            **FIXED_RATIO_ENV, "BLENDSERVE_INGEST_SAMPLE_ON_START": "false",
            "BLENDSERVE_STORE_REDIS_URL": "", "BLENDSERVE_AUTH_API_KEY": ""}


def _count(db: Path, table: str) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
            return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    except sqlite3.OperationalError:  # schema not created yet
        return 0


def _visible(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT doc_id, COUNT(*) FROM passages GROUP BY doc_id").fetchall())


def _kill_when(proc: subprocess.Popen, db: Path, written: int, timeout: float = 120) -> int:
    """SIGKILL `proc` once `written` passage rows (staged or visible) exist; the count at the kill."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        n = _count(db, "staged") + _count(db, "passages")
        if n >= written:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            return n
        time.sleep(0.01)
    raise AssertionError(f"the ingestion ended (rc {proc.poll()}) before {written} rows were written")


def _check_whole_or_absent(visible: dict[str, int], full: dict[str, int]) -> None:
    for doc_id, n in visible.items():
        assert n == full[doc_id], f"{doc_id} is half-visible: {n} of {full[doc_id]} passages"


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_sigkill_during_cli_ingestion_leaves_documents_whole_or_absent(env, tmp_path, capsys, monkeypatch):
    for k, v in env.items():
        if k.startswith("BLENDSERVE_") or k == "HF_HUB_OFFLINE":
            monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in corpus_docs()))
    clean = tmp_path / "clean"
    assert _cli(capsys, "--data-dir", str(clean), "ingest", "--no-progress", str(corpus))[0] == 0
    full = _visible(clean / "passages.sqlite3")
    assert len(full) == N_DOCS and min(full.values()) >= 3  # every document spans several batches
    total = sum(full.values())

    data = Path(env["BLENDSERVE_DATA_DIR"])
    db = data / "passages.sqlite3"
    cmd = [sys.executable, "-m", "corpus_tools", "ingest", "--no-progress", str(corpus)]
    saw_incomplete = False
    for point in (3, total // 2, total - 2):  # early, middle, late
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _kill_when(proc, db, point)
        visible = _visible(db)
        _check_whole_or_absent(visible, full)
        rc, out, _ = _cli(capsys, "verify", "--no-progress")
        named = {line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("incomplete: ")}
        staged = _staged_docs(db)
        assert named == staged and not staged & set(visible), (named, staged, visible)
        assert (rc == 0) == (not named)
        saw_incomplete |= bool(named)
    assert saw_incomplete, "no kill landed while a document was half-written"
    rc, out, err = _cli(capsys, "ingest", "--no-progress", str(corpus))
    assert rc == 0, err
    assert _visible(db) == full
    rc, out, err = _cli(capsys, "verify", "--no-progress")
    assert rc == 0 and "verify: OK" in out and "incomplete documents 0" in out, out + err


def _staged_docs(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        return {r[0] for r in conn.execute("SELECT DISTINCT doc_id FROM staged")}


class _Server:
    def __init__(self, env: dict, port: int, cwd: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=cwd, env={**env, "BLENDSERVE_SERVICE_PORT": str(port)},
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_url_ready(self.url, 120, proc=self.proc)
        except BaseException:
            self.proc.kill()  # never leave a server behind
            self.proc.wait(10)
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _post_in_background(url: str, docs: list[dict]) -> threading.Thread:
    def post() -> None:
        try:
            httpx.post(f"{url}/v1/documents", json={"documents": docs}, timeout=120)
        except httpx.HTTPError:
            pass  # the server is killed under it

    t = threading.Thread(target=post, daemon=True)
    t.start()
    return t


def test_sigkill_during_rest_ingestion_leaves_documents_whole_or_absent(env, tmp_path, free_port):
    docs = corpus_docs()
    db = Path(env["BLENDSERVE_DATA_DIR"]) / "passages.sqlite3"
    server = _Server(env, free_port(), tmp_path)
    try:
        for point in (2, 12):  # a first batch staged; several documents' worth staged
            poster = _post_in_background(server.url, docs)
            _kill_when(server.proc, db, point)
            poster.join(30)
            server = _Server(env, free_port(), tmp_path)  # restart on the same data
            for d in docs:  # a request is all or nothing, and it never got its answer: nothing is visible
                assert httpx.get(f"{server.url}/v1/documents/{d['doc_id']}", timeout=10).status_code == 404
            report = httpx.get(f"{server.url}/v1/verify", timeout=60).json()
            assert report["incomplete"] and set(report["incomplete"]) <= {d["doc_id"] for d in docs}
            assert not report["ok"]
            q = httpx.post(f"{server.url}/v1/query", json={"question": "What does item 1-2 weigh?", "max_tokens": 2},
                           timeout=60)
            assert q.status_code == 503  # the index holds nothing: no staged passage leaked into retrieval
        r = httpx.post(f"{server.url}/v1/documents", json={"documents": docs}, timeout=120)
        assert r.status_code == 201, r.text
        counts = {d["doc_id"]: len(httpx.get(f"{server.url}/v1/documents/{d['doc_id']}", timeout=10).json()["passages"])
                  for d in docs}
        assert min(counts.values()) >= 3
        report = httpx.get(f"{server.url}/v1/verify", timeout=60).json()
        assert report["ok"] and report["incomplete"] == [], report
    finally:
        server.stop()


def _wait_sample_done(url: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = httpx.get(f"{url}/readyz", timeout=10).json().get("ingestion") or {}
        if info.get("status") in ("done", "failed", "cancelled"):
            return info
        time.sleep(0.2)
    raise AssertionError(f"the sample ingestion did not end within {timeout} s: {info}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_first_start_stopped_anywhere_finishes_the_sample_once(env, tmp_path, free_port, sig):
    """Issue #38: a first start stopped (SIGTERM or SIGKILL) at random points of the sample ingestion
    finishes it on the next start: every document once, each passage once, a store that verifies."""
    docs = corpus_docs()
    sample = tmp_path / "sample.jsonl"
    sample.write_text("".join(json.dumps(d) + "\n" for d in docs))
    env = {**env, "BLENDSERVE_INGEST_SAMPLE_ON_START": "true", "BLENDSERVE_SAMPLE_CORPUS": str(sample)}
    db = Path(env["BLENDSERVE_DATA_DIR"]) / "passages.sqlite3"
    for point in sorted(random.Random(38 + sig).sample(range(1, 16), 2)):  # rows written when stopped
        server = _Server(env, free_port(), tmp_path)
        deadline = time.monotonic() + 120
        while _count(db, "staged") + _count(db, "passages") < point:
            assert time.monotonic() < deadline and server.proc.poll() is None, f"stalled before {point} rows"
            time.sleep(0.01)
        server.proc.send_signal(sig)
        server.proc.wait(60)
    server = _Server(env, free_port(), tmp_path)
    try:
        info = _wait_sample_done(server.url)
        assert info["status"] == "done" and info["processed"] == info["documents"] == len(docs), info
        with sqlite3.connect(db) as conn:
            rows = conn.execute("SELECT doc_id, seq, text FROM passages ORDER BY doc_id, seq").fetchall()
        by_doc: dict[str, list[int]] = {}
        for doc_id, seq, _ in rows:
            by_doc.setdefault(doc_id, []).append(seq)
        assert set(by_doc) == {d["doc_id"] for d in docs}
        for doc_id, seqs in by_doc.items():  # each passage once, none missing
            assert seqs == list(range(len(seqs))) and len(seqs) >= 3, (doc_id, seqs)
        assert len({(d, t) for d, _, t in rows}) == len(rows)
        report = httpx.get(f"{server.url}/v1/verify", timeout=120).json()
        assert report["ok"] and report["incomplete"] == [] and report["passages"] == len(rows), report
        with sqlite3.connect(Path(env["BLENDSERVE_DATA_DIR"]) / "jobs.sqlite3") as conn:
            assert conn.execute("SELECT COUNT(*) FROM jobs WHERE kind = 'sample'").fetchone()[0] == 1
        q = httpx.post(f"{server.url}/v1/query", json={"question": "What does item 1-2 weigh?", "max_tokens": 2},
                       timeout=60)
        assert q.status_code == 200, q.text
    finally:
        server.stop()
