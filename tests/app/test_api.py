"""In-process API tests (FastAPI TestClient) on a real stack built with the tiny model."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.main import create_app
from app.settings import ServiceSettings
from blend_engine.types import SelectionPolicy
from blendserve_config.settings import Settings
from tests.helpers import FIXED_RATIO, held_loop, make_settings, poll, serving, svc, wait_ready

MODES = ["blend", "full_prefill", "prefix_cache", "full_reuse"]
FIXTURE_DOCS = [
    {"doc_id": "paris", "title": "Paris", "text": "Paris is the capital and largest city of France. It hosts the Louvre."},
    {"doc_id": "berlin", "title": "Berlin", "text": "Berlin is the capital of Germany and its most populous city."},
    {"doc_id": "nile", "title": "Nile", "text": "The Nile is a major river in northeastern Africa, flowing into the "
                                                 "Mediterranean Sea."},
    {"doc_id": "everest", "title": "Mount Everest", "text": "Mount Everest is Earth's highest mountain above sea "
                                                            "level, in the Himalayas."},
]


def sse_events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.strip().split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        events.append((name, "\n".join(data)))
    return events


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_stack_factory):
    with serving(make_settings(tmp_path_factory.mktemp("api") / "data"), tiny_stack_factory, FIXTURE_DOCS) as c:
        yield c


# ============================================================================ health, docs, settings
def test_health_ready_and_docs(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["ready"] is True and ready["model"] == "tiny"
    assert ready["index"]["documents"] >= len(FIXTURE_DOCS)
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    for p in ("/v1/query", "/v1/chat/completions", "/v1/documents", "/v1/documents/{doc_id}", "/healthz", "/readyz",
              "/metrics"):
        assert p in paths


def test_readyz_is_503_until_the_stack_is_built(tmp_path, tiny_stack_factory):
    release = threading.Event()

    def slow_factory(settings):
        assert release.wait(30)
        return tiny_stack_factory(settings)

    app = create_app(make_settings(tmp_path / "data"), slow_factory)
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False
        q = c.post("/v1/query", json={"question": "q?"})
        assert q.status_code == 503 and q.headers["retry-after"]
        release.set()
        wait_ready(c)


def test_startup_failure_is_reported_by_readyz(tmp_path):
    def broken(settings):
        raise RuntimeError("no model here")

    with TestClient(create_app(make_settings(tmp_path / "data"), broken)) as c:
        deadline = time.monotonic() + 10
        while c.get("/readyz").json()["status"] != "error" and time.monotonic() < deadline:
            time.sleep(0.02)
        r = c.get("/readyz")
        assert r.status_code == 503 and "no model here" in r.json()["error"]
        assert c.get("/healthz").status_code == 200


def test_settings_fail_fast_naming_the_field(monkeypatch):
    with pytest.raises(ValidationError, match="port"):
        ServiceSettings(_env_file=None, port=0)
    monkeypatch.setenv("BLENDSERVE_SERVICE_MAX_QUEUE", "zero")
    with pytest.raises(ValidationError, match="max_queue"):
        ServiceSettings(_env_file=None)
    monkeypatch.delenv("BLENDSERVE_SERVICE_MAX_QUEUE")
    monkeypatch.setenv("BLENDSERVE_ENGINE_DEFAULT_MODE", "turbo")
    with pytest.raises(ValidationError, match="default_mode"):
        Settings(_env_file=None)


def test_memory_tier_budget_in_gb_is_an_alias_of_the_mb_setting(tmp_path, monkeypatch):
    from blendserve_config.stack import build_store_from

    assert Settings(_env_file=None, store={"memory_cache_mb": 64}).store.memory_cache_bytes == 64 << 20
    monkeypatch.setenv("BLENDSERVE_MEMORY_CACHE_MB", "64")
    monkeypatch.setenv("BLENDSERVE_MEMORY_CACHE_GB", "1.5")  # the old GB twin still wins over the old MB name
    with pytest.warns(DeprecationWarning, match="BLENDSERVE_STORE_MEMORY_CACHE_MB"):
        settings = Settings(_env_file=None, data_dir=tmp_path, store={"disk_direct_io": True, "kv_format": "fp16"})
    assert settings.store.memory_cache_mb == 1536 and settings.store.memory_cache_bytes == 3 << 29
    store = build_store_from(settings)
    assert store.tier("memory").stats().bytes_budget == 3 << 29 and store.tier("disk").direct_io
    store.close()
    monkeypatch.setenv("BLENDSERVE_STORE_MEMORY_CACHE_MB", "32")  # the new name wins over both
    assert Settings(_env_file=None).store.memory_cache_mb == 32
    monkeypatch.setenv("BLENDSERVE_MEMORY_CACHE_GB", "-1")
    monkeypatch.delenv("BLENDSERVE_STORE_MEMORY_CACHE_MB")
    with pytest.raises(ValidationError, match="memory_cache_mb"):
        Settings(_env_file=None)


SERVICE_GROUPS = ("service", "limits", "auth", "decoder")


def test_service_settings_extend_the_shared_ones(tmp_path, monkeypatch):
    shared, service = Settings.model_fields, ServiceSettings.model_fields
    assert not set(SERVICE_GROUPS) & set(shared) and set(service) == set(shared) | set(SERVICE_GROUPS)
    monkeypatch.chdir(tmp_path)  # one .env for both, as in a deployment
    (tmp_path / ".env").write_text("BLENDSERVE_SERVICE_MAX_QUEUE=3\nBLENDSERVE_SERVICE_PORT=8123\n"
                                   "BLENDSERVE_INGEST_CHUNK_TOKENS=128\n")
    monkeypatch.setenv("BLENDSERVE_SERVICE_WORKERS", "2")
    s = ServiceSettings()
    assert (s.service.max_queue, s.service.port, s.service.workers, s.ingest.chunk_tokens) == (3, 8123, 2, 128)
    cli = Settings()  # the CLI reads the same file and ignores the service's groups
    assert cli.ingest.chunk_tokens == 128 and not hasattr(cli, "service")


def test_create_app_refuses_the_shared_settings(tmp_path):
    with pytest.raises(TypeError, match="ServiceSettings"):
        create_app(Settings(_env_file=None, data_dir=tmp_path / "data"))


def test_several_apps_in_one_process_have_separate_registries(tmp_path):
    a = create_app(make_settings(tmp_path / "a"))
    b = create_app(make_settings(tmp_path / "b"))
    assert a.state.svc.metrics.registry is not b.state.svc.metrics.registry


# ============================================================================ /v1/query
@pytest.mark.parametrize("mode", MODES)
def test_query_with_retrieval(client, mode):
    r = client.post("/v1/query", json={"question": "What is the capital of France?", "top_k": 2, "mode": mode,
                                       "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["mode"] == mode and isinstance(body["answer"], str)
    assert len(body["passages"]) == 2
    assert all(isinstance(p["score"], float) for p in body["passages"])
    # best_last placement: the best passage sits next to the question
    assert body["passages"][-1]["title"] == "Paris"
    assert body["passages"][-1]["score"] >= body["passages"][0]["score"]
    assert set(body["timings"]) >= {"retrieval_ms", "kv_load_ms", "recompute_ms", "ttft_ms", "total_ms"}
    assert body["timings"]["retrieval_ms"] > 0 and body["timings"]["total_ms"] >= body["timings"]["ttft_ms"]
    stats = body["stats"]
    assert set(stats) >= {"context_tokens", "recomputed_tokens", "recompute_ratio", "cache_hits", "cache_misses"}
    assert 0 < stats["recomputed_tokens"] <= stats["context_tokens"]
    if mode == "full_prefill":
        assert stats["recomputed_tokens"] == stats["context_tokens"] and stats["recompute_ratio"] == 1.0
    if mode in ("blend", "full_reuse"):
        # system prefix, markers [1] [2] (stored at ingestion with it), the 2 ingested passages
        assert stats["cache_hits"] == 5 and stats["cache_misses"] == 0
        assert stats["recomputed_tokens"] < stats["context_tokens"]


@pytest.mark.parametrize("retrieval", ["dense", "lexical", "hybrid"])
def test_query_retrieval_modes_and_filters(client, retrieval):
    def titles(body: dict) -> list[str]:
        return [p["title"] for p in body["passages"]]

    base = {"question": "Which mountain is in the Himalayas?", "max_tokens": 2, "retrieval": retrieval}
    r = client.post("/v1/query", json={**base, "top_k": 1})
    assert r.status_code == 200, r.text
    assert titles(r.json()) == ["Mount Everest"]
    only_berlin = client.post("/v1/query", json={**base, "top_k": 3, "filters": {"doc_id_prefix": "ber"}})
    if retrieval == "lexical":  # Berlin's passage shares no word with the question
        assert only_berlin.status_code == 400 and "match" in only_berlin.json()["error"]["message"]
    else:
        assert titles(only_berlin.json()) == ["Berlin"]
    later = client.post("/v1/query", json={**base, "filters": {"ingested_after": "2999-01-01"}})
    assert later.status_code == 400 and "filters" in later.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": base["question"]}],
                                                     "max_tokens": 2, "top_k": 1, "retrieval": retrieval,
                                                     "filters": {"source": "api"}})
    assert chat.status_code == 200, chat.text
    assert [p["title"] for p in chat.json()["passages"]] == ["Mount Everest"]


@pytest.mark.parametrize("mode", MODES)
def test_query_with_inline_documents(client, mode):
    engine = svc(client).stack.engine
    docs = [{"title": f"Doc {mode}", "text": f"The password for {mode} is swordfish-{mode}."},
            {"text": f"Unrelated filler text about {mode} and the weather."}]
    payload = {"question": "What is the password?", "documents": docs, "mode": mode, "max_tokens": 4,
               "recompute_ratio": 0.3}
    r = client.post("/v1/query", json=payload)
    assert r.status_code == 200, r.text
    body = r.json()
    from retrieval.text import format_passage

    keys = [engine.key_of(engine.passage_tokens(format_passage(d["text"], d.get("title")))) for d in docs]
    assert [p["id"] for p in body["passages"]] == keys  # exactly these, in this order
    assert [p["title"] for p in body["passages"]] == [f"Doc {mode}", ""]
    assert all(p["score"] is None for p in body["passages"])
    if mode in ("blend", "full_reuse"):
        assert body["stats"]["cache_misses"] == 2
        assert body["timings"]["kv_store_ms"] == 0  # the answer did not wait for storing them ...
        poll(lambda: all(engine.store.contains(k) for k in keys))  # ... they are stored after it
        reordered = {**payload, "documents": docs[::-1]}  # a new order: not a prefix hit
        again = client.post("/v1/query", json=reordered).json()  # ... and a request needing them finds them
        assert again["stats"]["cache_misses"] == 0 and again["stats"]["cache_hits"] == 5  # + markers [1] [2]
        if mode == "blend":
            assert again["stats"]["recompute_ratio"] == pytest.approx(0.3)


def test_retrieval_and_planning_run_off_the_event_loop(client, monkeypatch):
    """Retrieval (embedding, rerank) and the engine's planning (tokenizing, chunk keys, block hashes)
    run on a worker thread: no request's retrieval stalls another's stream on the event loop."""
    import asyncio

    stack = svc(client).stack
    seen: dict[str, list[str]] = {"search": [], "prepare": []}

    def where() -> str:
        try:
            asyncio.get_running_loop()
            return "event loop"
        except RuntimeError:
            return "worker"

    def spy(name: str, fn):
        def wrapped(*args, **kwargs):
            seen[name].append(where())
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(stack.retriever, "search", spy("search", stack.retriever.search))
    monkeypatch.setattr(stack.engine, "prepare", spy("prepare", stack.engine.prepare))
    r = client.post("/v1/query", json={"question": "Where is the Eiffel Tower?", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert seen == {"search": ["worker"], "prepare": ["worker"]}


def test_query_stream(client):
    r = client.post("/v1/query", json={"question": "Where is the Louvre?", "top_k": 2, "max_tokens": 6,
                                       "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    deltas = [json.loads(d)["text"] for e, d in events if e == "delta"]
    assert events[-1][0] == "done" and len(deltas) >= 1
    final = json.loads(events[-1][1])
    assert final["answer"] == "".join(deltas)
    assert set(final) >= {"answer", "passages", "mode", "timings", "stats"}
    assert final["timings"]["ttft_ms"] <= final["timings"]["total_ms"]


# ============================================================================ explain
def check_explain(body: dict, tokenizer=None) -> dict:
    """The invariants every explained response keeps; returns body["explain"]."""
    ex, stats = body["explain"], body["stats"]
    assert [p["index"] for p in ex["passages"]] == list(range(len(body["passages"])))
    assert [(p["id"], p["title"]) for p in ex["passages"]] == [(p["id"], p["title"]) for p in body["passages"]]
    # counted the same way: every prompt position in the final recomputed set
    assert ex["passage_recomputed_tokens"] == sum(p["recomputed_tokens"] for p in ex["passages"])
    others = ex["markers"] + ex["turns"]  # the [n] markers and a conversation's earlier messages
    assert len(ex["markers"]) == len(ex["passages"])
    assert ex["system"]["recomputed_tokens"] + ex["passage_recomputed_tokens"] + ex["question"]["recomputed_tokens"] \
        + sum(o["recomputed_tokens"] for o in others) == stats["recomputed_tokens"]
    assert ex["system"]["n_tokens"] + sum(p["n_tokens"] for p in ex["passages"]) + ex["question"]["n_tokens"] \
        + sum(o["n_tokens"] for o in others) == stats["context_tokens"]
    listed = sum(len(p["tokens"]) for p in ex["passages"]) + len(ex["question"]["tokens"])
    assert listed == ex["explained_tokens"] <= ex["max_tokens"]
    for p in ex["passages"]:
        assert len(p["tokens"]) == len(p["recomputed"]) == len(p["scores"]) <= p["n_tokens"]
        assert p["truncated"] == (len(p["tokens"]) < p["n_tokens"])
        if not p["truncated"]:
            assert sum(p["recomputed"]) == p["recomputed_tokens"]
    q = ex["question"]
    assert all(q["recomputed"]) and q["recomputed_tokens"] == q["n_tokens"]  # always recomputed
    assert ex["truncated"] == (listed < sum(p["n_tokens"] for p in ex["passages"]) + q["n_tokens"])
    return ex


@pytest.mark.parametrize("mode", MODES)
def test_query_explain(client, mode):
    from blend_engine.layout import passage_text
    from retrieval.text import format_passage

    r = client.post("/v1/query", json={"question": "What is the capital of France?", "top_k": 3, "mode": mode,
                                       "max_tokens": 3, "recompute_ratio": 0.2 if mode == "blend" else None,
                                       "explain": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ex = check_explain(body)
    assert not ex["truncated"]
    by_title = {d["title"]: d for d in FIXTURE_DOCS}
    for p in ex["passages"]:  # the pieces are the passage text as placed in the prompt
        doc = by_title[p["title"]]
        assert "".join(p["tokens"]) == passage_text(format_passage(doc["text"], doc["title"]))
    assert "".join(ex["question"]["tokens"]).count("What is the capital of France?") == 1
    if mode == "blend":
        assert ex["check_layer"] == SelectionPolicy().check_layer and "deviation" in ex["metric"]
        assert all(p["cache"] == "hit" and p["tier"] == "memory" for p in ex["passages"])
        assert all(s is not None and s >= 0 for p in ex["passages"] for s in p["scores"])
        assert 0 < ex["passage_recomputed_tokens"] < sum(p["n_tokens"] for p in ex["passages"])
        assert ex["system"]["recomputed_tokens"] == 0 and ex["system"]["cache"] == "hit"
    else:
        assert ex["check_layer"] is None and ex["metric"] == "none"
        assert all(s is None for p in ex["passages"] for s in p["scores"])
    if mode == "full_prefill":
        assert {p["cache"] for p in ex["passages"]} == {"off"}
        assert all(all(p["recomputed"]) for p in ex["passages"])
    if mode == "full_reuse":
        assert ex["passage_recomputed_tokens"] == 0


def test_explain_is_off_by_default(client):
    r = client.post("/v1/query", json={"question": "Where is the Louvre?", "top_k": 2, "max_tokens": 2})
    assert r.status_code == 200 and "explain" not in r.json()
    r = client.post("/v1/query", json={"question": "Where is the Louvre?", "top_k": 2, "max_tokens": 2,
                                       "explain": False})
    assert "explain" not in r.json()
    assert client.post("/v1/query", json={"question": "q?", "explain": "yes"}).status_code == 422


def test_explain_with_a_missed_passage_and_streaming(client):
    docs = [{"title": "Cached", "text": FIXTURE_DOCS[1]["text"]},
            {"title": "Fresh", "text": "Explain-stream passage: the Danube flows into the Black Sea."}]
    r = client.post("/v1/query", json={"question": "Where does the Danube flow?", "max_tokens": 4, "stream": True,
                                       "documents": docs, "mode": "blend", "explain": True})
    events = sse_events(r.text)
    assert events[-1][0] == "done", r.text
    body = json.loads(events[-1][1])
    ex = check_explain(body)
    fresh = ex["passages"][1]
    assert fresh["cache"] == "miss" and fresh["tier"] is None and all(fresh["recomputed"])
    assert all(s is None for s in fresh["scores"])  # it did not compete: recomputed whole


def test_explain_cap_cuts_and_says_so(tmp_path, tiny_stack_factory):
    with serving(make_settings(tmp_path / "data", explain_max_tokens=12), tiny_stack_factory, FIXTURE_DOCS) as c:
        r = c.post("/v1/query", json={"question": "What is the capital of Germany?", "top_k": 3, "max_tokens": 2,
                                      "recompute_ratio": 0.5, "explain": True})
        assert r.status_code == 200, r.text
        body = r.json()
        ex = check_explain(body)  # the counts still add up to stats.recomputed_tokens
        assert ex["truncated"] and ex["max_tokens"] == 12 and ex["explained_tokens"] == 12
        first = ex["passages"][0]
        assert first["n_tokens"] > 12 and len(first["tokens"]) == 12 and first["truncated"]
        assert all(p["tokens"] == [] and p["truncated"] for p in ex["passages"][1:])
        assert ex["question"]["tokens"] == [] and ex["question"]["truncated"]
        assert ex["question"]["recomputed_tokens"] == ex["question"]["n_tokens"] > 0


@pytest.mark.parametrize("n", [1, 4])
def test_a_chat_request_touches_two_threads_for_any_n(client, monkeypatch, n):
    """The event loop (admission, streaming, the body), the query threads (retrieval, layout: a
    bounded pool, `app.host_work`) and the engine loop (the model), nothing else: no thread per
    request or per choice."""
    from blend_engine.client import RequestStream

    stack = client.app.state.svc.stack
    seen: dict[str, set[str]] = {}

    def spy(owner, name: str) -> None:
        real = getattr(owner, name)

        def recording(*args, **kwargs):
            seen.setdefault(name, set()).add(threading.current_thread().name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, recording)

    for owner, name in [(stack.retriever, "search"), (stack.engine, "prepare"), (stack.engine.runner, "finish_layer"),
                        (stack.engine.runner, "embed")]:
        spy(owner, name)
    real_sink = RequestStream.sink
    monkeypatch.setattr(RequestStream, "sink", lambda self, i, item: (
        seen.setdefault("sink", set()).add(threading.current_thread().name), real_sink(self, i, item))[1])
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Highest mountain?"}],
                                                  "max_tokens": 3, "n": n, "temperature": 0.8, "seed": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == n
    threads = set().union(*seen.values())
    assert seen.keys() == {"search", "prepare", "finish_layer", "embed", "sink"}
    host = seen["search"] | seen["prepare"]
    assert threads == host | {"engine-loop"} and seen["sink"] <= host | {"engine-loop"}, seen
    assert all(t.startswith("query-host") for t in host) and len(host) <= svc(client).settings.service.query_threads
    assert seen["finish_layer"] == seen["embed"] == seen["sink"] == {"engine-loop"}


def test_chat_explain_in_extra_body(client):
    from openai import OpenAI

    oa = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    messages = [{"role": "user", "content": "What is the capital of Germany?"}]
    resp = oa.chat.completions.create(model="blendserve", messages=messages, max_tokens=3,
                                      extra_body={"top_k": 2, "mode": "blend", "explain": True})
    blend = resp.model_extra["blend"]
    check_explain({**blend, "passages": resp.model_extra["passages"]})
    plain = oa.chat.completions.create(model="blendserve", messages=messages, max_tokens=3, extra_body={"top_k": 2})
    assert "explain" not in plain.model_extra["blend"]


def test_both_endpoints_give_the_same_body_in_the_same_field_order(client):
    """The JSON layout (every key, in order) of /v1/query and of chat's `passages`, `blend` and
    `usage`, streamed or not: the presenter builds one body that both endpoints show."""
    question, blend = "What is the capital of Germany?", {"top_k": 2, "mode": "blend", "recompute_ratio": 0.3}
    query = {"question": question, "max_tokens": 3, "explain": True, **blend}
    chat = {"messages": [{"role": "user", "content": question}], "max_tokens": 3, "explain": True, **blend}

    def untimed(body: dict) -> dict:
        return {k: v for k, v in body.items() if k != "timings"}

    body = client.post("/v1/query", json=query).json()
    assert list(body) == ["answer", "passages", "mode", "finish_reason", "timings", "stats", "sources", "logprobs",
                          "explain"]
    assert [list(p) for p in body["passages"]] == [["id", "title", "score", "doc_id", "location"]] * 2
    assert list(body["timings"]) == ["retrieval_ms", "kv_load_ms", "recompute_ms", "ttft_ms", "total_ms", "queue_ms",
                                     "plan_ms", "prefill_ms", "decode_ms", "kv_store_ms", "blend_ms", "handover_ms",
                                     "decoder_ttft_ms", "decoder_ms"]
    assert [body["timings"][k] for k in ("blend_ms", "handover_ms", "decoder_ttft_ms", "decoder_ms")] == [None] * 4
    assert list(body["stats"]) == ["context_tokens", "recomputed_tokens", "recompute_ratio", "cache_hits",
                                   "cache_misses", "prefix_tokens_reused", "ratio_source", "completion_tokens",
                                   "fallback", "decoder", "decoder_cached_tokens"]
    assert body["stats"]["decoder"] == "own" and body["stats"]["decoder_cached_tokens"] is None
    ex = body["explain"]
    assert list(ex) == ["check_layer", "metric", "max_tokens", "explained_tokens", "truncated",
                        "passage_recomputed_tokens", "system", "passages", "question", "markers", "turns"]
    assert list(ex["system"]) == ["n_tokens", "recomputed_tokens", "cache", "tier"]
    assert [list(p) for p in ex["passages"]] == [["index", "id", "title", "n_tokens", "recomputed_tokens", "cache",
                                                  "tier", "tokens", "recomputed", "scores", "truncated"]] * 2
    assert list(ex["question"]) == ["n_tokens", "recomputed_tokens", "tokens", "recomputed", "truncated"]
    done = json.loads(sse_events(client.post("/v1/query", json={**query, "stream": True}).text)[-1][1])
    assert untimed(done) == untimed(body) and list(done) == list(body)

    got = client.post("/v1/chat/completions", json=chat).json()
    assert list(got) == ["id", "object", "created", "model", "choices", "usage", "passages", "sources", "notes",
                         "blend"]
    assert got["passages"] == body["passages"] and got["sources"] == body["sources"]
    assert list(got["blend"]) == ["mode", "timings", "stats", "search", "turns", "explain"]
    assert untimed(got["blend"]) == {"mode": body["mode"], "stats": body["stats"], "explain": body["explain"],
                                     "search": question, "turns": 0}
    assert list(got["blend"]["timings"]) == list(body["timings"])
    stats = body["stats"]
    assert got["usage"] == {"prompt_tokens": stats["context_tokens"], "completion_tokens": stats["completion_tokens"],
                            "total_tokens": stats["context_tokens"] + stats["completion_tokens"],
                            "prompt_tokens_details": {"cached_tokens": stats["context_tokens"]
                                                      - stats["recomputed_tokens"]}}
    r = client.post("/v1/chat/completions", json={**chat, "stream": True, "stream_options": {"include_usage": True}})
    frames = [json.loads(d) for _, d in sse_events(r.text) if d != "[DONE]"]
    final, last = frames[-2], frames[-1]
    assert list(final) == ["id", "object", "created", "model", "choices", "passages", "sources", "notes", "blend"]
    assert final["passages"] == got["passages"] and untimed(final["blend"]) == untimed(got["blend"])
    assert list(last) == ["id", "object", "created", "model", "choices", "usage"] and last["usage"] == got["usage"]


def test_explain_in_the_openapi_schema(client):
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert "explain" in schemas["QueryRequest"]["properties"]
    assert "explain" in schemas["ChatCompletionRequest"]["properties"]
    assert "explain" in schemas["QueryExplainedResponse"]["properties"]
    assert {"tokens", "recomputed", "scores", "cache", "tier", "truncated"} <= set(schemas["PassageExplain"]["properties"])
    ok = spec["paths"]["/v1/query"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    refs = json.dumps(ok)
    assert "QueryExplainedResponse" in refs and "QueryResponse" in refs


def test_prompt_too_long_is_400_naming_sizes(client):
    store = svc(client).stack.store
    entries = store.stats().entries
    doc = {"text": "lorem ipsum dolor " * 900}
    for stream in (False, True):
        r = client.post("/v1/query", json={"question": "What?", "documents": [doc], "stream": stream})
        assert r.status_code == 400, r.text
        assert "2048" in r.json()["detail"] and "tokens" in r.json()["detail"]
    assert store.stats().entries == entries  # nothing stored by the failed requests


def test_empty_index_is_503_with_retry_after_not_400(tmp_path, tiny_stack_factory):
    """Nothing searchable yet is not the caller's fault: 503, Retry-After and the ingestion's progress."""
    with TestClient(create_app(make_settings(tmp_path / "data"), tiny_stack_factory)) as c:
        wait_ready(c)
        for stream in (False, True):
            r = c.post("/v1/query", json={"question": "Anything?", "stream": stream})
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] and r.json()["error"]["code"] == "index_empty"
            assert "ingestion" in r.json() and "searchable" in r.json()["detail"]


# ============================================================================ OpenAI chat completions
def test_chat_completions_with_the_openai_client(client):
    from openai import OpenAI

    oa = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    extra = {"mode": "full_prefill", "top_k": 2}
    messages = [{"role": "user", "content": "What is the capital of Germany?"}]
    resp = oa.chat.completions.create(model="blendserve", messages=messages, max_tokens=5, temperature=0,
                                      extra_body=extra)
    assert resp.object == "chat.completion" and resp.model == "blendserve"
    answer = resp.choices[0].message.content
    assert isinstance(answer, str) and resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1 and resp.usage.prompt_tokens > resp.usage.completion_tokens
    passages = resp.model_extra["passages"]
    assert [p["title"] for p in passages][-1] == "Berlin"

    stream = oa.chat.completions.create(model="blendserve", messages=messages, max_tokens=5, temperature=0,
                                        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer  # full_prefill at temperature 0 is deterministic
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["passages"] == passages
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens

    models = oa.models.list()
    assert [m.id for m in models.data] == [svc(client).settings.model.name]


def test_chat_with_inline_documents_and_system_message(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Answer tersely."},
                     {"role": "user", "content": [{"type": "text", "text": "Which river?"}]}],
        "documents": [{"title": "River", "text": "The Amazon river crosses Brazil."}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["passages"][0]["title"] == "River" and body["passages"][0]["score"] is None
    assert body["blend"]["mode"] == "blend" and "ttft_ms" in body["blend"]["timings"]


@pytest.mark.parametrize(("payload", "field"), [
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "q?"}], "n": 9}, "n"),
    ({"messages": [{"role": "user", "content": "q?"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "q?"}], "temperature": 5}, "temperature"),
    ({"messages": [{"role": "robot", "content": "q?"}]}, "role"),
])
def test_chat_validation(client, payload, field):
    r = client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 422, r.text
    assert field in r.json()["error"]["message"]


# ============================================================================ documents
def test_ingest_get_and_delete_a_document(client):
    engine = svc(client).stack.engine
    doc = {"doc_id": "mars-note", "title": "Mars", "text": "Olympus Mons on Mars is the tallest volcano known."}
    r = client.post("/v1/documents", json={"documents": [doc]})
    assert r.status_code == 201, r.text
    summary = r.json()
    assert summary["doc_ids"] == ["mars-note"] and summary["new_passages"] == 1 and summary["errors"] == []
    got = client.get("/v1/documents/mars-note")
    assert got.status_code == 200
    passages = got.json()["passages"]
    assert passages[0]["text"] == doc["text"] and engine.store.contains(passages[0]["kv_key"])

    q = client.post("/v1/query", json={"question": "Which is the tallest volcano on Mars?", "top_k": 1,
                                       "max_tokens": 2}).json()
    assert q["passages"][0]["id"] == passages[0]["id"] and q["stats"]["cache_hits"] == 3  # sys, [1], the passage

    again = client.post("/v1/documents", json={"documents": [doc]}).json()  # idempotent
    assert again["new_passages"] == 0 and again["skipped"] == 1

    # ids from the file readers are relative paths: slashes and spaces work
    nested = {"doc_id": "notes/solar system.md", "text": "Jupiter is the largest planet."}
    assert client.post("/v1/documents", json={"documents": [nested]}).json()["doc_ids"] == [nested["doc_id"]]
    assert client.get("/v1/documents/notes/solar system.md").json()["doc_id"] == nested["doc_id"]
    assert client.delete("/v1/documents/notes/solar system.md").status_code == 204

    assert client.delete("/v1/documents/mars-note").status_code == 204
    assert client.get("/v1/documents/mars-note").status_code == 404
    assert client.delete("/v1/documents/mars-note").status_code == 404
    assert not engine.store.contains(passages[0]["kv_key"])
    q = client.post("/v1/query", json={"question": "Which is the tallest volcano on Mars?", "top_k": 1,
                                       "max_tokens": 2}).json()
    assert q["passages"][0]["id"] != passages[0]["id"]


# ============================================================================ validation and limits
@pytest.mark.parametrize(("payload", "field"), [
    ({}, "question"),
    ({"question": ""}, "question"),
    ({"question": "   "}, "question"),
    ({"question": "x" * 4001}, "question"),
    ({"question": "q?", "top_k": 0}, "top_k"),
    ({"question": "q?", "top_k": 51}, "top_k"),
    ({"question": "q?", "max_tokens": 0}, "max_tokens"),
    ({"question": "q?", "max_tokens": 5000}, "max_tokens"),
    ({"question": "q?", "mode": "turbo"}, "mode"),
    ({"question": "q?", "recompute_ratio": 1.5}, "recompute_ratio"),
    ({"question": "q?", "temperature": -1}, "temperature"),
    ({"question": "q?", "stream": "maybe"}, "stream"),
    ({"question": "q?", "documents": []}, "documents"),
    ({"question": "q?", "documents": [{"title": "t"}]}, "documents.0.text"),
    ({"question": "q?", "documents": [{"text": "  "}]}, "documents.0.text"),
    ({"question": "q?", "documents": [{"text": "a"}] * 33}, "documents"),
    ({"question": "q?", "documents": [{"text": "a" * 100_001}]}, "documents.0.text"),
    ({"question": "q?", "surprise": 1}, "surprise"),
    ({"question": "q?", "top_k": True}, "top_k"),  # strict: no bool -> int, no str -> float coercion
    ({"question": "q?", "recompute_ratio": "0.3"}, "recompute_ratio"),
    ({"question": "q?", "max_tokens": 2.5}, "max_tokens"),
    ({"question": "q?", "retrieval": "sparse"}, "retrieval"),
    ({"question": "q?", "filters": {"ingested_after": "last tuesday"}}, "filters.ingested_after"),
    ({"question": "q?", "filters": {"colour": "red"}}, "filters.colour"),
])
def test_query_validation_errors_are_422_naming_the_field(client, payload, field):
    r = client.post("/v1/query", json=payload)
    assert r.status_code == 422, r.text
    body = r.json()
    assert field in body["error"]["message"]
    assert body["detail"] and body["error"]["type"] == "invalid_request_error"


def test_malformed_json_is_422(client):
    r = client.post("/v1/query", content=b'{"question": "hi",', headers={"content-type": "application/json"})
    assert r.status_code == 422
    err = r.json()["error"]
    assert "invalid JSON at character 18" in err["message"] and err["param"] is None


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/query", '{"question": "hi", "recompute_ratio": NaN}', "recompute_ratio"),
    ("/v1/query", '{"question": "hi", "temperature": Infinity}', "temperature"),
    ("/v1/query", '{"question": "hi", "top_k": 1e400}', "top_k"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "q?"}], "top_p": -Infinity}', "top_p"),
])
def test_non_finite_numbers_are_422_not_500(client, path, body, field):
    """Python's JSON reader accepts NaN/Infinity; the error must still be reportable as JSON."""
    r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert field in r.json()["error"]["message"]
    assert client.post("/v1/query", json={"question": "Where is Paris?", "top_k": 1, "max_tokens": 1}).status_code == 200


def test_a_body_that_is_not_json_is_415(client):
    r = client.post("/v1/query", content=b"question=hi", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert client.post("/v1/nowhere", json={}).json()["error"]["code"] == "not_found"


def test_ingest_validation(client):
    assert client.post("/v1/documents", json={"documents": []}).status_code == 422
    r = client.post("/v1/documents", json={"documents": [{"text": "x" * 100_001}]})
    assert r.status_code == 422 and "documents.0.text" in r.json()["error"]["message"]
    r = client.post("/v1/documents", json={"documents": [{"text": "a"}] * 33})
    assert r.status_code == 422 and "documents" in r.json()["error"]["message"]
    r = client.post("/v1/documents", json={"documents": [{"text": "a", "doc_id": ""}]})
    assert r.status_code == 422 and "doc_id" in r.json()["error"]["message"]


def test_body_too_large_is_413(tmp_path, tiny_stack_factory):
    app = create_app(make_settings(tmp_path / "data", max_body_bytes=2048), tiny_stack_factory)
    with TestClient(app) as c:
        big = {"question": "q?", "documents": [{"text": "y" * 4000}]}
        r = c.post("/v1/query", json=big)
        assert r.status_code == 413 and "2048" in r.json()["detail"]

        def chunks():  # no Content-Length: counted while reading
            yield json.dumps(big).encode()

        r = c.post("/v1/query", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


# ============================================================================ auth
def test_api_key_guards_everything_but_health(tmp_path, tiny_stack_factory):
    app = create_app(make_settings(tmp_path / "data", api_key="s3cret"), tiny_stack_factory)
    with TestClient(app) as c:
        wait_ready(c)
        assert c.get("/healthz").status_code == 200
        doc = {"documents": [{"text": "Secret text."}]}
        for method, path, body in [("post", "/v1/query", {"question": "q?"}), ("get", "/metrics", None),
                                   ("post", "/v1/documents", doc), ("get", "/v1/documents/x", None),
                                   ("delete", "/v1/documents/x", None), ("get", "/openapi.json", None),
                                   ("post", "/v1/chat/completions", {"messages": []})]:
            kwargs = {"json": body} if body is not None else {}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
                r = c.request(method, path, headers=headers, **kwargs)
                assert r.status_code == 401, (method, path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/documents", json=doc, headers=ok).status_code == 201
        r = c.post("/v1/query", json={"question": "What is secret?", "max_tokens": 2}, headers=ok)
        assert r.status_code == 200, r.text
        assert c.get("/metrics", headers=ok).status_code == 200


# ============================================================================ load: queue full, timeout
@contextmanager
def _engine_held(c) -> Iterator[object]:
    """The service's engine loop, started by a first query, then held busy (`held_loop`). Yields the loop."""
    body = {"question": "q?", "documents": [{"text": "Warm the loop."}], "max_tokens": 1}
    assert c.post("/v1/query", json=body).status_code == 200  # the loop thread runs from here on
    loop = c.app.state.svc.stack.engine.loop
    with held_loop(loop):
        yield loop


def test_full_queue_is_503_with_retry_after_from_the_one_admission_point(tmp_path, tiny_stack_factory):
    """A batch of one, empty, and a queue of two: the first queued request has the batch's free
    place, the next two fill the queue, and the rest are refused."""
    settings = make_settings(tmp_path / "data", max_queue=2, engine={"recompute_ratio": FIXED_RATIO, "max_batch": 1})
    with serving(settings, tiny_stack_factory) as c:
        doc = {"documents": [{"text": "Queue text."}]}
        queued: list[int] = []
        with _engine_held(c) as loop:
            waiting = [threading.Thread(target=lambda: queued.append(c.post("/v1/query", json={
                "question": "q?", "max_tokens": 2, **doc}).status_code)) for _ in range(3)]
            for t in waiting:
                t.start()
            poll(lambda: loop.admission.queued == 3, 10.0)
            for path, body in [("/v1/query", {"question": "q?", **doc}), ("/v1/query", {"question": "q?",
                                                                                        "stream": True, **doc}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q?"}], **doc})]:
                r = c.post(path, json=body)
                assert r.status_code == 503, (path, r.text)
                assert r.json()["error"]["code"] == "overloaded" and "queue is full" in r.json()["error"]["message"]
                assert int(r.headers["retry-after"]) >= 1
            retriever, searched = c.app.state.svc.stack.retriever, []
            real_search = retriever.search
            retriever.search = lambda *a, **k: searched.append(1) or real_search(*a, **k)
            try:  # refused before any retrieval is spent on it
                assert c.post("/v1/query", json={"question": "Queue text?"}).status_code == 503 and not searched
            finally:
                del retriever.search
            metrics = c.get("/metrics").text
            assert "blendserve_queue_depth 3.0" in metrics and "blendserve_rejected_total 4.0" in metrics
            assert 'blendserve_admission_total{decision="refused_queue_full"} 4.0' in metrics
        for t in waiting:
            t.join(30)
        assert queued == [200, 200, 200]  # the queued ones were answered once the loop was free
        poll(lambda: loop.admission.queued == 0 and loop.admission.running == 0, 10.0)
        r = c.post("/v1/query", json={"question": "q?", "documents": [{"text": "After the storm."}], "max_tokens": 2})
        assert r.status_code == 200


def test_request_timeout_is_504_and_leaves_no_state(tmp_path, tiny_stack_factory):
    with serving(make_settings(tmp_path / "data", request_timeout_s=0.3), tiny_stack_factory) as c:
        body = {"question": "q?", "documents": [{"text": "Timeout text."}], "max_tokens": 2}
        with _engine_held(c) as loop:
            assert c.post("/v1/query", json=body).status_code == 504
            assert c.post("/v1/query", json={**body, "stream": True}).status_code == 504
            assert loop.admission.queued == 2  # both still queued behind the held loop, but aborted
        poll(lambda: loop.admission.queued == 0 and loop.admission.running == 0, 10.0)
        assert loop.stats()["running"] == 0 and loop.stats()["kv_blocks_in_use"] == 0
        # the aborted requests never ran: their passage was not stored
        engine = c.app.state.svc.stack.engine
        from retrieval.text import format_passage

        assert not engine.store.contains(engine.key_of(engine.passage_tokens(format_passage("Timeout text."))))
        assert "blendserve_timeouts_total 2.0" in c.get("/metrics").text
        c.app.state.svc.settings.service.request_timeout_s = 60
        assert c.post("/v1/query", json=body).status_code == 200


# ============================================================================ metrics, sample corpus
def test_metrics_after_queries(client):
    client.post("/v1/query", json={"question": "Highest mountain?", "top_k": 2, "max_tokens": 2, "mode": "blend"})
    text = client.get("/metrics").text
    for needle in ['blendserve_ttft_seconds_bucket{le="0.01",mode="blend"}',
                   'blendserve_request_latency_seconds_count{mode="blend"}',
                   'blendserve_passage_cache_lookups_total{result="hit",tier="engine"}',
                   'blendserve_kv_store_hits_total{tier="memory"}',
                   'blendserve_kv_store_misses_total{tier="disk"}',
                   'blendserve_recomputed_tokens_total{mode="blend"}',
                   'blendserve_recompute_ratio_bucket{le="0.15",mode="blend"}',
                   "blendserve_recompute_ratio_last", "blendserve_queue_depth 0.0",
                   "blendserve_batch_running 0.0", "blendserve_batch_kv_bytes 0.0", "blendserve_decode_steps_total",
                   "blendserve_kv_store_queued", "blendserve_kv_store_background_total",
                   "blendserve_kv_pool_evictions_total",
                   'blendserve_requests_total{endpoint="/v1/query",status="200"}']:
        assert needle in text, needle


def test_metrics_count_the_passages_stored_after_their_answers(client):
    """Inline documents seen for the first time: the answer goes out, their KV is stored after it, and
    /metrics counts it (the queue drains to 0)."""
    def series(name: str) -> float:
        lines = [ln for ln in client.get("/metrics").text.splitlines() if ln.startswith(name + " ")]
        return float(lines[0].rpartition(" ")[2])

    before = series("blendserve_kv_store_background_total")
    docs = [{"text": "A passage seen once: the kiln fires at dawn."}, {"text": "Another one: the mill grinds rye."}]
    r = client.post("/v1/query", json={"question": "When does the kiln fire?", "documents": docs, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["stats"]["cache_misses"] >= 2
    poll(lambda: series("blendserve_kv_store_queued") == 0 and series("blendserve_kv_store_background_total") > before)
    assert series("blendserve_kv_store_background_total") - before >= 2


def test_metrics_time_the_engine_steps_by_kind(client):
    """A query's prefill and decode steps are counted and timed by kind, with the CPU time they kept busy
    and the prefill work they carried."""
    client.post("/v1/query", json={"question": "Highest mountain?", "top_k": 2, "max_tokens": 3, "mode": "blend"})
    values = {}
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(("blendserve_engine_step", "blendserve_engine_prefill")):
            values[name] = float(value)
    for kind in ("decode", "prefill"):
        assert values[f'blendserve_engine_steps_total{{kind="{kind}"}}'] >= 1, kind
        assert values[f'blendserve_engine_step_seconds_total{{kind="{kind}"}}'] > 0, kind
    assert values["blendserve_engine_step_cpu_seconds_total"] > 0
    assert values["blendserve_engine_prefill_token_layers_total"] > 0  # the prefill's rows, layer by layer
    assert 1 <= values["blendserve_engine_prefill_step_budget"] <= 4096  # ENGINE_PREFILL_STEP_TOKENS at most


def test_sample_corpus_is_ingested_on_first_start_only(tmp_path, tiny_stack_factory, caplog):
    sample = tmp_path / "sample.jsonl"
    sample.write_text("\n".join(json.dumps({"title": f"T{i}", "text": f"Sample fact number {i}."})
                                for i in range(3)) + "\n")
    settings = make_settings(tmp_path / "data", ingest_sample_on_start=True, sample_corpus=sample)
    caplog.set_level("INFO", logger="app.startup")
    with TestClient(create_app(settings, tiny_stack_factory)) as c:  # a background job (tests/app/test_jobs.py)
        deadline = time.monotonic() + 60
        while (ready := wait_ready(c))["ingestion"]["status"] != "done" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready["index"]["documents"] == 3
    assert "ingesting the sample corpus" in caplog.text
    caplog.clear()
    with TestClient(create_app(settings, tiny_stack_factory)) as c:
        assert wait_ready(c)["index"]["documents"] == 3
    assert "sample corpus" not in caplog.text


def test_top_k_limit_ignored_when_documents_are_given(tmp_path, tiny_stack_factory):
    """A request that brings its own passages does not use top_k, so its default (5) may exceed MAX_TOP_K."""
    with serving(make_settings(tmp_path / "data", max_top_k=2), tiny_stack_factory) as c:
        docs = [{"title": "Paris", "text": "Paris is the capital of France."}]
        r = c.post("/v1/query", json={"question": "What is the capital of France?", "max_tokens": 1, "documents": docs})
        assert r.status_code == 200, r.text
        r = c.post("/v1/query", json={"question": "What is the capital of France?", "max_tokens": 1, "top_k": 3})
        assert r.status_code == 422 and "top_k" in r.text
