"""Reliability regressions (issue 18): bad input is a 4xx naming the field, a storage fault is a
JSON 5xx naming its cause, timed-out work stops and commits nothing, documents are visible whole
or not at all, re-ingesting replaces, a corrupt KV index rebuilds itself, logs cannot be forged,
and /readyz tells strangers nothing but ready or not."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.main import create_app
from app.settings import ServiceSettings
from corpus_tools.documents import Document
from tests.helpers import make_settings, serving, svc, wait_ready

DOCS = [
    {"doc_id": "paris", "title": "Paris", "text": "Paris is the capital and largest city of France."},
    {"doc_id": "nile", "title": "Nile", "text": "The Nile is a major river in northeastern Africa."},
]


def post_raw(client: TestClient, path: str, body: dict, **kw):
    """Send `body` as JSON with \\u escapes (so lone surrogates travel as the issue sent them)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"}, **kw)


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_stack_factory):
    with serving(make_settings(tmp_path_factory.mktemp("rel") / "data"), tiny_stack_factory, DOCS) as c:
        yield c


# ============================================================================ 1. lone surrogates
SURROGATE_CASES = [
    ("/v1/documents", {"documents": [{"text": "ok", "title": "\ud83d"}]}, "documents.0.title"),
    ("/v1/documents", {"documents": [{"text": "ok \udc00", "doc_id": "s1"}]}, "documents.0.text"),
    ("/v1/documents", {"documents": [{"text": "ok", "doc_id": "x\ud800"}]}, "documents.0.doc_id"),
    ("/v1/query", {"question": "q?", "documents": [{"title": "\ud800", "text": "p"}]}, "documents.0.title"),
    ("/v1/query", {"question": "q\ud800?"}, "question"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be \ud800 nice"},
                                           {"role": "user", "content": "hi"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/chat/completions", {"stop": ["\ud800"], "messages": [{"role": "user", "content": "hi"}]}, "stop.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
     "messages.0.name"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES)
def test_lone_surrogate_is_a_422_naming_the_field(client, path, body, param):
    calls = []
    engine = svc(client).stack.engine
    orig = engine.start
    engine.start = lambda *a, **k: calls.append(1) or orig(*a, **k)  # nothing may be generated first
    try:
        r = post_raw(client, path, body)
    finally:
        del engine.start
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]
    assert not calls


# ============================================================================ 2. title limits
def test_title_limit_and_title_must_fit_a_passage(tmp_path, tiny_stack_factory):
    with serving(make_settings(tmp_path / "data", chunk_tokens=32, max_title_chars=120), tiny_stack_factory) as c:
        long_title = "word " * 2000
        r = c.post("/v1/documents", json={"documents": [{"text": "ok", "title": long_title}]})
        assert r.status_code == 422 and r.json()["error"]["param"] == "documents.0.title"
        assert "120" in r.json()["error"]["message"]
        r = c.post("/v1/query", json={"question": "q?", "documents": [{"text": "ok", "title": long_title}]})
        assert r.status_code == 422 and r.json()["error"]["param"] == "documents.0.title"
        # within the character limit but too many tokens for a 32-token passage: 422, nothing stored
        heavy = "Zq Xv Jk Wp Qz Vb Kx Jq Zx Pq Wz Xj Qv Bz Kq Jx Vz Qp Xw Zk Jv Wq Xz Kv"
        r = c.post("/v1/documents", json={"documents": [{"text": "ten words of text " * 2, "title": heavy,
                                                         "doc_id": "heavy"}]})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "documents.0.title" and "passage" in r.json()["error"]["message"]
        assert c.get("/v1/documents/heavy").status_code == 404
        assert svc(c).stack.pipeline.db.counts()["passages"] == 0


def test_title_limit_is_a_setting(monkeypatch):
    assert ServiceSettings(_env_file=None).limits.max_title_chars >= 100
    monkeypatch.setenv("BLENDSERVE_LIMITS_MAX_TITLE_CHARS", "0")
    with pytest.raises(ValidationError, match="max_title_chars"):
        ServiceSettings(_env_file=None)


# ============================================================================ 3. a timed-out ingestion commits nothing
def test_timed_out_ingestion_is_rolled_back(tmp_path, tiny_stack_factory):
    with serving(make_settings(tmp_path / "data", request_timeout_s=1.0, ingest_batch_size=2), tiny_stack_factory) as c:
        s = svc(c)
        chunks = s.stack.engine.chunks
        slow = chunks.precompute
        stops = []  # the stop check each precompute was handed (explicitly, by the route)

        def precompute(ids, should_stop=None):
            stops.append(should_stop)
            time.sleep(0.15)
            return slow(ids, should_stop)

        chunks.precompute = precompute
        try:
            docs = [{"doc_id": f"t{i}", "title": f"T{i}", "text": f"Timed document number {i} about topic {i}."}
                    for i in range(16)]
            t0 = time.monotonic()
            r = c.post("/v1/documents", json={"documents": docs})
            assert r.status_code == 504, r.text
            while (s.worker.running or s.worker.depth) and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            assert s.worker.running == 0
            # it stopped soon after its deadline, not after all 16 documents (2.4 s of precompute)
            assert time.monotonic() - t0 < 2.2
            assert stops and all(stop is not None for stop in stops) and stops[-1]()  # the job's, now past its deadline
        finally:
            del chunks.precompute
        assert s.stack.pipeline.db.counts()["passages"] == 0
        assert len(s.stack.pipeline.index) == 0
        assert all(c.get(f"/v1/documents/t{i}").status_code == 404 for i in range(16))


# ============================================================================ 4. atomic documents, verify
def _pipeline(client):
    return svc(client).stack.pipeline


def test_a_document_is_visible_whole_or_not_at_all_and_verify_names_it(client):
    pipe = _pipeline(client)
    text = " ".join(f"Sentence {i} of the long document talks about subject {i} at length." for i in range(60))
    doc = Document(text=text, title="Long", doc_id="atomic-long")
    chunks = pipe.engine.chunks
    real = chunks.precompute
    seen = []

    def dies_later(token_ids, should_stop=None):
        seen.append(token_ids)
        if len(seen) == 5:
            raise KeyboardInterrupt("simulated crash")
        return real(token_ids, should_stop)

    old_batch = pipe.batch_size
    pipe.batch_size = 2
    chunks.precompute = dies_later
    try:
        with pytest.raises(KeyboardInterrupt):
            pipe.ingest([doc], publish="batch")
    finally:
        del chunks.precompute
        pipe.batch_size = old_batch
    assert pipe.get_document("atomic-long") is None
    assert all(h.doc_id != "atomic-long" for h in svc(client).stack.retriever.search("subject long document", 10))
    report = pipe.verify()
    assert "atomic-long" in report.incomplete and not report.ok
    assert any("atomic-long" in p and "incomplete" in p for p in report.problems)
    r = client.get("/v1/verify")
    assert r.status_code == 200 and "atomic-long" in r.json()["incomplete"]
    # re-running completes it
    summary = pipe.ingest([doc])
    got = pipe.get_document("atomic-long")
    assert got is not None and len(got["passages"]) == summary.passages > 4
    assert "atomic-long" not in pipe.verify().incomplete


# ============================================================================ 8. re-ingesting replaces
def test_reingesting_a_doc_id_replaces_the_document(client):
    r = client.post("/v1/documents", json={"documents": [{"doc_id": "plant", "text": "The plant produces 10 MW."}]})
    assert r.status_code == 201
    pipe = _pipeline(client)
    before = len(pipe.index)
    r = client.post("/v1/documents", json={"documents": [{"doc_id": "plant", "text": "The plant produces 25 MW."}]})
    assert r.status_code == 201
    doc = client.get("/v1/documents/plant").json()
    assert [p["text"] for p in doc["passages"]] == ["The plant produces 25 MW."]
    assert len(pipe.index) == before  # the old vector went with its passage
    hits = svc(client).stack.retriever.search("How much does the plant produce?", 10)
    assert not any("10 MW" in h.text for h in hits)
    assert pipe.verify().ok


# ============================================================================ 9. doc_id with control characters
@pytest.mark.parametrize("doc_id", ["a\nb", "a\rb", "x\x1b[31mred", "tab\there", "nul\x00"])
def test_doc_id_with_control_characters_is_a_422(client, doc_id):
    r = post_raw(client, "/v1/documents", {"documents": [{"doc_id": doc_id, "text": "Some text."}]})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "documents.0.doc_id" and "control" in r.json()["error"]["message"]


# ============================================================================ 10. log injection
def test_logged_user_values_have_control_characters_escaped(client, caplog):
    from logsafe import printable

    evil = "id\r\n\x1b[2Jforged line"
    assert printable(evil) == "id\\r\\n\\x1b[2Jforged line"
    assert printable("plain text, é ü") == "plain text, é ü"
    with caplog.at_level(logging.INFO):
        logging.getLogger("corpus_tools.pipeline").info("deleted document %s (%d passages)", evil, 1)
    message = caplog.records[-1].getMessage()
    assert "\r" not in message and "\n" not in message and "\x1b" not in message
    assert "forged line" in message


# ============================================================================ 7. storage faults are JSON 5xx naming the cause
class _DiskFullOnCommit:
    """A sqlite3 connection whose COMMIT fails the way a full disk does (SQLite rolls back itself)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql, *args):
        if sql.strip().upper() == "COMMIT":
            self._conn.execute("ROLLBACK")
            raise sqlite3.OperationalError("database or disk is full")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_delete_on_a_full_disk_is_a_json_507_naming_the_cause(client):
    db = _pipeline(client).db
    real = db._conn
    db._conn = _DiskFullOnCommit(real)
    try:
        r = client.delete("/v1/documents/paris")
    finally:
        db._conn = real
    assert r.status_code == 507, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert "disk is full" in r.json()["error"]["message"]
    assert client.get("/v1/documents/paris").status_code == 200  # nothing was half-deleted
    assert "blendserve_storage_errors_total" in client.get("/metrics").text


def test_a_corrupt_chunk_read_is_repaired_not_a_400(client):
    """A KV blob of the wrong size (a storage fault) is dropped and recomputed: a 200, never the caller's 4xx."""
    stack = svc(client).stack
    body = {"question": "Which river?", "documents": [{"title": "Nile", "text": "The Nile flows north."}],
            "max_tokens": 2}
    # now in the chunk store; full_reuse's KV in the pool is not blend's to take, so blend reads the store
    assert client.post("/v1/query", json={**body, "mode": "full_reuse"}).status_code == 200
    store = stack.store
    real = store.get_blob

    def short_blob(key, layer):
        got = real(key, layer)
        return None if got is None else (got[0], bytearray(3))

    store.get_blob = short_blob
    try:
        r = client.post("/v1/query", json=body)
    finally:
        del store.get_blob
    assert r.status_code == 200, r.text
    assert r.json()["stats"]["cache_misses"] >= 1


def test_an_unrepairable_storage_fault_is_a_logged_counted_5xx(client, caplog):
    from blend_engine.errors import StorageError

    stack = svc(client).stack

    def broken(*a, **k):
        raise StorageError("disk read failed: I/O error")

    stack.retriever.search = broken
    try:
        with caplog.at_level(logging.ERROR):
            r = client.post("/v1/query", json={"question": "Which river?", "max_tokens": 2})
    finally:
        del stack.retriever.search
    assert r.status_code == 503 and r.json()["error"]["code"] == "storage_error"
    assert "I/O error" in r.json()["error"]["message"]
    assert any("storage" in rec.getMessage() for rec in caplog.records)
    metrics = client.get("/metrics").text
    assert 'blendserve_storage_errors_total' in metrics


# ============================================================================ 6. cancellation between layers
def test_an_aborted_query_stops_between_layers_of_prefill(client):
    from app.service import QueryRun, QuerySpec
    from blend_engine.cancel import Cancelled
    from blend_engine.types import GenerationConfig, Mode

    s = svc(client)
    runner = s.stack.engine.runner
    holder, layers = [], []
    real = runner.finish_layer

    def counting(layer, hidden, out):  # on the engine loop's thread
        layers.append(layer)
        if len(layers) == 2:
            holder[0].abort()
        return real(layer, hidden, out)

    spec = QuerySpec(question="What is long?", top_k=1, documents=None, mode=Mode.FULL_PREFILL,
                     recompute_ratio=None, gen=GenerationConfig(max_tokens=4))

    async def query() -> None:
        run = await QueryRun.start(s.stack, s.require_client(), spec, 30.0)
        holder.append(run)
        await run.finish()

    runner.finish_layer = counting
    try:
        with pytest.raises(Cancelled):
            asyncio.run(query())
    finally:
        del runner.finish_layer
    assert len(layers) <= 3, f"{len(layers)} layers ran after the abort"
    loop = s.stack.engine.loop
    assert loop.admission.running == 0 and loop.stats()["kv_blocks_in_use"] == 0


def test_queued_work_past_its_deadline_never_starts():
    from app.worker import EngineWorker

    worker = EngineWorker(1, 4)
    try:
        gate = threading.Event()
        started = []
        first = worker.submit(lambda job: gate.wait(5), "blocker")
        late = worker.submit(lambda job: started.append(1), "late", timeout_s=0.1)
        time.sleep(0.3)
        gate.set()
        first.future.result(5)
        with pytest.raises(Exception, match="deadline"):
            late.future.result(5)
        assert not started
    finally:
        worker.close()



def test_a_job_stopped_at_its_own_deadline_is_a_timeout_not_a_cancel():
    """The job's deadline starts before the route's timer, so the job can stop at a checkpoint first:
    that is still the request's timeout (504), not a cancellation (503). A job asked to stop stays a cancel."""
    from app.worker import Cancelled, EngineWorker

    def stops_at_deadline(job):
        job.deadline = time.monotonic() - 1  # its deadline has passed (the route's 5 s timer has not)
        assert job.cancelled
        raise Cancelled("ingest cancelled at layer 1")

    def asked_to_stop(job):
        job.cancel()
        raise Cancelled("ingest cancelled at layer 1")

    worker = EngineWorker(1, 4)
    try:
        with pytest.raises(TimeoutError, match="stopped at its deadline"):
            asyncio.run(worker.run(stops_at_deadline, 5.0, "ingest"))
        with pytest.raises(Cancelled):
            asyncio.run(worker.run(asked_to_stop, 5.0, "ingest"))
    finally:
        worker.close()


def _measured_worker(took_s: float):
    """A one-thread worker that has seen one "q" job take `took_s`."""
    from app.worker import EngineWorker

    worker = EngineWorker(1, 8)
    worker.submit(lambda job: time.sleep(took_s), "q").future.result(5)
    assert worker.expected_s("q") == pytest.approx(took_s, rel=0.5, abs=0.05)
    return worker


def test_work_that_cannot_finish_before_its_deadline_is_refused_or_skipped():
    """Goodput near the timeout: a query whose wait plus run would pass its deadline gets a quick 503
    (Overloaded) instead of a late 504, and a queued one whose time left is shorter than a query takes
    is not started."""
    from blend_engine.errors import Overloaded

    worker = _measured_worker(0.3)
    try:
        gate = threading.Event()
        blocker = worker.submit(lambda job: gate.wait(5), "q", timeout_s=5)
        started = []
        doomed = worker.submit(lambda job: started.append(1), "q", timeout_s=0.7)  # 1 ahead: ~0.6 s, fits
        with pytest.raises(Overloaded, match="longer than the request's"):
            worker.submit(lambda job: None, "q", timeout_s=0.8)  # 2 ahead: ~0.9 s, does not
        time.sleep(0.5)  # doomed now has ~0.2 s left, less than the 0.3 s a query takes
        gate.set()
        blocker.future.result(5)
        with pytest.raises(Exception, match="could not finish before its deadline"):
            doomed.future.result(5)
        assert not started
        assert worker.submit(lambda job: 7, "q", timeout_s=5).future.result(5) == 7  # room again: runs
    finally:
        worker.close()


def test_estimates_never_starve_a_kind_of_job():
    """With nothing ahead, or when such jobs usually run past the timeout, no job is refused or skipped."""
    worker = _measured_worker(0.3)
    try:
        assert worker.submit(lambda job: 1, "q", timeout_s=0.2).future.result(5) == 1  # idle: runs anyway
        gate = threading.Event()
        blocker = worker.submit(lambda job: gate.wait(5), "slow", timeout_s=5)
        other = worker.submit(lambda job: 2, "never-measured", timeout_s=5)
        gate.set()
        blocker.future.result(5)
        assert other.future.result(5) == 2
    finally:
        worker.close()


# ============================================================================ 5. corrupt KV index
def test_a_corrupt_kv_index_is_moved_aside_and_rebuilt(tmp_path, caplog):
    import torch

    from blend_engine.kv_store import ChunkKV
    from blend_engine.kv_store.disk import DiskStore

    root = tmp_path / "kv"
    store = DiskStore(root, kv_format="fp16")
    kv = ChunkKV(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))
    assert store.put("abcdef", kv)
    store.close()
    (root / "index.sqlite").write_bytes(b"this is not a database" * 100)
    for extra in ("index.sqlite-wal", "index.sqlite-shm"):
        (root / extra).unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING):
        again = DiskStore(root, kv_format="fp16")
    try:
        assert again.contains("abcdef") and again.get("abcdef") is not None
        assert list(root.glob("index.sqlite.corrupt-*")), "the bad file was not kept aside"
        assert any("index" in r.getMessage() and "corrupt" in r.getMessage() for r in caplog.records)
        assert again.put("fedcba", kv)  # the new index takes writes
    finally:
        again.close()
    with sqlite3.connect(root / "index.sqlite") as conn:
        assert {r[0] for r in conn.execute("SELECT key FROM entries")} == {"abcdef", "fedcba"}


# ============================================================================ 11. readiness details behind auth
def test_readyz_discloses_nothing_without_the_key(tmp_path, tiny_stack_factory):
    app = create_app(make_settings(tmp_path / "data", api_key="s3cret"), tiny_stack_factory)
    auth = {"Authorization": "Bearer s3cret"}
    with TestClient(app) as c:
        wait_ready(c)
        body = c.get("/readyz").json()
        assert body["ready"] is True and set(body) <= {"ready", "status", "reason"}
        assert str(tmp_path) not in json.dumps(body)
        assert c.get("/v1/status").status_code == 401
        status = c.get("/v1/status", headers=auth).json()
        assert status["ready"] is True and "documents" in status["index"] and status["store"] is not None
        assert c.get("/metrics").status_code == 401


def test_readyz_without_the_key_hides_startup_error_details(tmp_path):
    def broken(settings):
        raise RuntimeError(f"cannot open {settings.data_dir}/secret.db")

    with TestClient(create_app(make_settings(tmp_path / "data", api_key="k"), broken)) as c:
        deadline = time.monotonic() + 10
        while c.get("/readyz").json()["status"] != "error" and time.monotonic() < deadline:
            time.sleep(0.02)
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False and r.json()["reason"]
        assert "secret.db" not in r.text
        detail = c.get("/v1/status", headers={"Authorization": "Bearer k"})
        assert detail.status_code == 503 and "secret.db" in detail.text


def test_a_non_ascii_api_key_is_refused_at_start_up():
    with pytest.raises(ValidationError, match="api_key") as exc:
        ServiceSettings(_env_file=None, api_key="clé-secrète")
    assert "ASCII" in str(exc.value)


def test_stream_errors_after_the_headers_say_whose_fault_it_is():
    """An error sent inside a stream (status already 200) carries the same type a plain response would:
    a timeout or a storage fault is the server's, a bad request the caller's."""
    from app.service import BadRequest, RequestTimeout, StorageFault
    from app.streaming import stream_error

    assert stream_error(RequestTimeout("too slow"))["error"]["type"] == "server_error"
    assert stream_error(StorageFault("disk gone"))["error"]["type"] == "server_error"
    assert stream_error(BadRequest("bad"))["error"]["type"] == "invalid_request_error"
