"""Issue #38, the first minutes: ready before the fidelity gate (blend `checking`, served by full
prefill), a question before anything is searchable gets 503 + Retry-After + progress (then an
answer once the first batch is published), and sources that carry the cited passage's text
(`GET /v1/passages/{id}` 200/404/401)."""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.service import GATE_CHECKING
from blend_engine.selfcheck import GateDecision
from tests.app.test_api import FIXTURE_DOCS, sse_events
from tests.helpers import held_ingest_factory, make_settings, poll, serving, svc, wait_ready

QUERY = {"question": "What is the capital of France?", "top_k": 2, "max_tokens": 3, "mode": "full_prefill"}


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_stack_factory):
    with serving(make_settings(tmp_path_factory.mktemp("first") / "data"), tiny_stack_factory, FIXTURE_DOCS) as c:
        yield c


def _stored(client, passage_id: str):
    return svc(client).stack.pipeline.db.get_many([passage_id])[passage_id]


# ============================================================================ sources with their text
def test_sources_text_equals_the_stored_passage_and_get_passage(client):
    body = client.post("/v1/query", json=QUERY).json()
    assert len(body["sources"]) == 2
    for source in body["sources"]:
        row = _stored(client, source["id"])
        assert source["text"] == row.text and source["truncated"] is False
        r = client.get(f"/v1/passages/{source['id']}")
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["text"] == row.text and got["doc_id"] == source["doc_id"] and got["title"] == source["title"]
    r = client.get("/v1/passages/no-such-passage")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_supplied_documents_are_sources_with_their_text(client):
    docs = [{"title": "A", "text": "Alpha is first."}, {"text": "Beta is second."}]
    body = client.post("/v1/query", json={**QUERY, "documents": docs}).json()
    assert [s["text"] for s in body["sources"]] == [d["text"] for d in docs]


def test_stream_sends_sources_before_the_first_token(client):
    r = client.post("/v1/query", json={**QUERY, "stream": True})
    events = sse_events(r.text)
    names = [name for name, _ in events]
    assert names[0] == "sources" and "delta" in names and names.count("sources") == 1, names
    sources = json.loads(events[0][1])["sources"]
    done = json.loads(events[-1][1])
    assert [s["text"] for s in sources] == [s["text"] for s in done["sources"]]
    assert sources[0]["text"] == _stored(client, sources[0]["id"]).text


def test_openai_stream_sends_sources_before_the_first_token(client):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": QUERY["question"]}]}),
                       ("/v1/completions", {"prompt": QUERY["question"]})):
        r = client.post(path, json={**body, "model": "x", "stream": True, "max_tokens": 3, "top_k": 2,
                                    "mode": "full_prefill"})
        chunks = [json.loads(d) for _, d in sse_events(r.text) if d != "[DONE]"]
        first_text = next(i for i, c in enumerate(chunks) if c["choices"] and (
            c["choices"][0].get("text") or (c["choices"][0].get("delta") or {}).get("content")))
        with_sources = [i for i, c in enumerate(chunks) if "sources" in c]
        assert with_sources and with_sources[0] < first_text, (path, with_sources, first_text)
        for s in chunks[with_sources[0]]["sources"]:
            assert s["text"] == _stored(client, s["id"]).text


def test_source_text_cap(tmp_path, tiny_stack_factory):
    with serving(make_settings(tmp_path / "data", source_text_chars=12), tiny_stack_factory, FIXTURE_DOCS) as c:
        body = c.post("/v1/query", json=QUERY).json()
        for s in body["sources"]:
            full = _stored(c, s["id"]).text
            assert s["text"] == full[:12] and s["truncated"] is (len(full) > 12)
        chat = c.post("/v1/chat/completions", json={"model": "x", "max_tokens": 2, "top_k": 2, "mode": "full_prefill",
                                                    "messages": [{"role": "user", "content": "France?"}]}).json()
        assert all(len(s["text"]) <= 12 for s in chat["sources"])


def test_get_passage_needs_a_key(tmp_path, tiny_stack_factory):
    with serving(make_settings(tmp_path / "data", api_key="k1", tenant_keys={"acme": "k2"}), tiny_stack_factory) as c:
        for key in ("k1", "k2"):
            r = c.post("/v1/documents", json={"documents": FIXTURE_DOCS[:1]}, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 201, r.text
        passage_id = svc(c).stack.pipeline.db.all_rows()[0].id
        assert c.get(f"/v1/passages/{passage_id}").status_code == 401
        assert c.get(f"/v1/passages/{passage_id}", headers={"Authorization": "Bearer nope"}).status_code == 401
        for key in ("k1", "k2"):  # the passage store is shared; only the KV cache is per tenant
            r = c.get(f"/v1/passages/{passage_id}", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.json()["text"] == FIXTURE_DOCS[0]["text"]
        assert c.get("/v1/passages/none", headers={"Authorization": "Bearer k1"}).status_code == 404


# ============================================================================ ready before the gate
def test_ready_while_the_gate_checks_blend_served_by_full_prefill(tmp_path, tiny_stack_factory, monkeypatch):
    release, started = threading.Event(), threading.Event()

    def slow_decide(mode, runner, config, data_dir, **_):
        started.set()
        assert release.wait(30)
        return GateDecision(mode, None)

    monkeypatch.setattr("app.startup.decide", slow_decide)
    settings = make_settings(tmp_path / "data", fidelity_gate="enforce")
    with serving(settings, tiny_stack_factory, FIXTURE_DOCS) as c:
        assert started.wait(30)
        ready = c.get("/readyz").json()
        assert ready["ready"] is True and ready["blend"]["state"] == "checking", ready
        body = c.post("/v1/query", json={**QUERY, "mode": "blend"}).json()
        assert body["mode"] == "full_prefill" and body["stats"]["fallback"] == GATE_CHECKING
        release.set()
        poll(lambda: c.get("/readyz").json()["blend"]["state"] == "on")
        body = c.post("/v1/query", json={**QUERY, "mode": "blend"}).json()
        assert body["mode"] == "blend" and body["stats"]["fallback"] is None


# ============================================================================ searchable early
def test_question_during_sample_ingestion_503_then_answer(tmp_path, tiny_stack_factory):
    """Before the sample's first batch is published: 503 + Retry-After + progress (never 400); after it:
    an answer over what is in."""
    sample = tmp_path / "sample.jsonl"
    sample.write_text("".join(json.dumps({"title": d["title"], "text": d["text"]}) + "\n" for d in FIXTURE_DOCS))
    release = threading.Event()

    held_factory = held_ingest_factory(tiny_stack_factory, release)

    settings = make_settings(tmp_path / "data", ingest_sample_on_start=True, sample_corpus=sample)
    with TestClient(create_app(settings, held_factory)) as c:
        wait_ready(c)
        poll(lambda: (c.get("/readyz").json().get("ingestion") or {}).get("status") == "running")
        for stream in (False, True):
            r = c.post("/v1/query", json={**QUERY, "stream": stream})
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) > 0
            progress = r.json()["ingestion"]
            assert progress["status"] == "running" and progress["documents"] == len(FIXTURE_DOCS)
            assert progress["passages"] == 0
        release.set()
        poll(lambda: (c.get("/readyz").json()["ingestion"] or {}).get("passages"))
        r = c.post("/v1/query", json=QUERY)
        assert r.status_code == 200, r.text
        assert r.json()["sources"] and all(s["text"] for s in r.json()["sources"])
        done = poll(lambda: (info := c.get("/v1/status").json()["ingestion"])["status"] == "done" and info)
        assert done["processed"] == done["documents"] == len(FIXTURE_DOCS) and done["eta_s"] == 0.0


def test_first_start_gate_waits_for_the_first_searchable_passages(tmp_path, tiny_stack_factory, monkeypatch):
    """On a first start the gate begins once the sample's first batch is searchable (the first answer
    needs the CPU more than blend does); blend is `checking` meanwhile."""
    sample = tmp_path / "sample.jsonl"
    sample.write_text("".join(json.dumps({"title": d["title"], "text": d["text"]}) + "\n" for d in FIXTURE_DOCS))
    release, decided = threading.Event(), threading.Event()
    seen: list[int] = []
    stacks: list = []

    def decide(mode, runner, config, data_dir, **_):
        seen.append(stacks[0].pipeline.db.counts()["passages"])  # passages searchable when the gate starts
        decided.set()
        return GateDecision(mode, None)

    held_factory = held_ingest_factory(tiny_stack_factory, release, stacks)

    monkeypatch.setattr("app.startup.decide", decide)
    settings = make_settings(tmp_path / "data", ingest_sample_on_start=True, sample_corpus=sample,
                             fidelity_gate="enforce")
    with TestClient(create_app(settings, held_factory)) as c:
        ready = wait_ready(c)
        assert ready["blend"]["state"] == "checking"
        poll(lambda: (c.get("/readyz").json().get("ingestion") or {}).get("status") == "running")
        assert not decided.is_set()
        release.set()
        assert decided.wait(60)
        assert seen and seen[0] > 0, seen
        poll(lambda: c.get("/readyz").json()["blend"]["state"] == "on")
