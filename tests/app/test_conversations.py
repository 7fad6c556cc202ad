"""Chat as a conversation, the OpenAI fields (n, stop, seed, usage, refused fields), /v1/completions,
sources and tenant keys, on the tiny model in-process (fast; the real model and real clients are in
test_openai_clients.py)."""

from __future__ import annotations

import json

import pytest

from app.auth import cache_namespace
from app.conversation import ConversationError, exchanges_to_drop, from_messages, is_follow_up, retrieval_query
from blend_engine.types import Turn
from tests.helpers import make_settings, serving, stored_after_answers

DOCS = [
    {"doc_id": "paris", "title": "Paris", "text": "Paris is the capital and largest city of France."},
    {"doc_id": "berlin", "title": "Berlin", "text": "Berlin is the capital of Germany, on the river Spree."},
]


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_stack_factory):
    with serving(make_settings(tmp_path_factory.mktemp("conv") / "data"), tiny_stack_factory, DOCS) as c:
        yield c


# ============================================================================ the conversation rules
def test_messages_become_system_turns_and_the_latest_question():
    conv = from_messages([("system", "Be brief."), ("user", "Who wrote it?"), ("assistant", "Caryl Churchill."),
                          ("developer", "Cite."), ("user", "When was she born?")])
    assert conv.system == "Be brief.\n\nCite."
    assert conv.turns == (Turn("user", "Who wrote it?"), Turn("assistant", "Caryl Churchill."))
    assert (conv.question, conv.question_index) == ("When was she born?", 4)
    # consecutive messages of one role are one turn; two user messages at the end are one question
    merged = from_messages([("user", "a"), ("user", "b"), ("assistant", "c"), ("user", "d"), ("user", "e")])
    assert merged.turns == (Turn("user", "a\n\nb"), Turn("assistant", "c")) and merged.question == "d\n\ne"
    with pytest.raises(ConversationError) as err:
        from_messages([("user", "q"), ("assistant", "a")])
    assert err.value.loc == ("messages", 1, "role")


def test_retrieval_searches_a_follow_up_with_the_exchange_before_it():
    turns = (Turn("user", "Who wrote The Skriker?"), Turn("assistant", "Caryl Churchill wrote it."))
    assert is_follow_up("When was she born?") and is_follow_up("And Berlin?") and is_follow_up("what about 1994")
    assert not is_follow_up("Which river flows through Berlin?")
    assert retrieval_query(turns, "When was she born?") == \
        "Who wrote The Skriker? Caryl Churchill wrote it. When was she born?"
    assert retrieval_query(turns, "Which river flows through Berlin?") == "Which river flows through Berlin?"
    assert retrieval_query((), "When was she born?") == "When was she born?"  # nothing to lean on


def test_trimming_drops_whole_exchanges_oldest_first():
    roles = ["user", "assistant", "user", "assistant"]
    assert exchanges_to_drop([10, 20, 30, 40], roles, 0) == 0
    assert exchanges_to_drop([10, 20, 30, 40], roles, 5) == 2  # the whole first exchange, not half of it
    assert exchanges_to_drop([10, 20, 30, 40], roles, 31) == 4
    assert exchanges_to_drop([10, 20, 30, 40], roles, 1000) == 4  # everything, then the engine's own 400


def test_cache_namespace_is_none_for_a_single_tenant():
    assert cache_namespace(None, None) is None
    names = {cache_namespace("a", None), cache_namespace("b", None), cache_namespace(None, "a"),
             cache_namespace("a", "x"), cache_namespace(None, '"tenant": "a"')}
    assert len(names) == 5  # unambiguous: no tenant can forge another's namespace with a salt


# ============================================================================ over HTTP
def test_chat_n_seed_stop_usage_and_sources(client):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6,
            "temperature": 1.0, "seed": 3, "n": 2, "top_k": 2, "recompute_ratio": 0.3}  # fixed: not the controller's
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    texts = [c["message"]["content"] for c in got["choices"]]
    assert [c["index"] for c in got["choices"]] == [0, 1] and texts[0] != texts[1]
    assert [c["message"]["content"] for c in client.post("/v1/chat/completions", json=body).json()["choices"]] == texts
    assert got["usage"]["completion_tokens"] == 12  # both choices, 6 tokens each (the random model never stops)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert [(s["index"], s["doc_id"], s["passage"]) for s in got["sources"]] == \
        [(1, got["passages"][0]["doc_id"], 0), (2, got["passages"][1]["doc_id"], 0)]

    # n=2 streamed: each choice's chunks carry its index; joined they are the same texts
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    frames = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    streamed = {0: "", 1: ""}
    for f in frames:
        for ch in f["choices"]:
            streamed[ch["index"]] += ch["delta"].get("content") or ""
    assert [streamed[0], streamed[1]] == texts
    assert [f["choices"][0]["finish_reason"] for f in frames[-2:]] == ["length", "length"]

    greedy = {**body, "temperature": 0, "n": 1, "max_tokens": 8}
    full = client.post("/v1/chat/completions", json=greedy).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.post("/v1/chat/completions", json={**greedy, "stop": stop}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == full[:full.find(stop)]


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"guided_json": {}}, "guided_json"),
])
def test_fields_the_server_cannot_honour_are_a_400_naming_them(client, extra, param):
    body = {"messages": [{"role": "user", "content": "q?"}], "max_tokens": 2, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "unsupported_parameter"


def test_tool_messages_and_image_parts_are_refused(client):
    for messages, param in [([{"role": "user", "content": "q"}, {"role": "tool", "content": "x", "tool_call_id": "1"},
                              {"role": "user", "content": "q2"}], "messages.1.role"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                             "messages.0.content.0.type")]:
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}], "top_logprobs": 2})
    assert r.status_code == 422 and "top_logprobs" in r.text  # needs logprobs: true, as OpenAI says


def test_completions(client):
    r = client.post("/v1/completions", json={"prompt": "What is the capital of Germany?", "max_tokens": 4, "top_k": 2})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
    assert got["usage"]["completion_tokens"] == 4 and got["choices"][0]["finish_reason"] == "length"
    assert len(got["sources"]) == 2
    for body, code in [({"prompt": ["a", "b"]}, 422), ({"prompt": "q", "echo": True}, 400),
                       ({"prompt": "q", "best_of": 3}, 400), ({"prompt": "q", "suffix": "x"}, 400)]:
        assert client.post("/v1/completions", json=body).status_code == code, body


def test_tenant_keys_authenticate(tmp_path, tiny_stack_factory):
    settings = make_settings(tmp_path / "data", api_key="shared-key", tenant_keys={"acme": "acme-key"})
    with serving(settings, tiny_stack_factory) as c:
        q = {"question": "q?", "documents": [{"text": "A passage."}], "max_tokens": 1}
        for key, code in [("shared-key", 200), ("acme-key", 200), ("nope", 401)]:
            assert c.post("/v1/query", json=q, headers={"Authorization": f"Bearer {key}"}).status_code == code
        assert c.get("/readyz", headers={"Authorization": "Bearer acme-key"}).json().get("model")  # details
    with pytest.raises(ValueError, match="tenant"):
        make_settings(tmp_path / "d2", tenant_keys={"a": "same", "b": "same"})
    with pytest.raises(ValueError, match="API_KEY"):
        make_settings(tmp_path / "d3", api_key="k", tenant_keys={"a": "k"})


def test_query_logprobs(client):
    q = {"question": "What is the capital of Germany?", "max_tokens": 4, "top_k": 2, "recompute_ratio": 0.3,
         "logprobs": True, "top_logprobs": 2}
    body = client.post("/v1/query", json=q).json()
    assert len(body["logprobs"]["content"]) == body["stats"]["completion_tokens"] == 4
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in body["logprobs"]["content"])
    events = client.post("/v1/query", json={**q, "stream": True}).text
    streamed = [t for line in events.splitlines() if line.startswith("data: ") and '"text"' in line
                and line.startswith('data: {"text"') for t in json.loads(line[6:]).get("logprobs", [])]
    assert [t["token"] for t in streamed] == [t["token"] for t in body["logprobs"]["content"]]
    assert client.post("/v1/query", json={**q, "logprobs": False, "top_logprobs": None}).json()["logprobs"] is None


def test_tenants_and_cache_salts_never_share_kv(tmp_path, tiny_stack_factory):
    settings = make_settings(tmp_path / "data", api_key="shared", tenant_keys={"acme": "acme-key", "globex": "g-key"})
    with serving(settings, tiny_stack_factory) as c:
        r = c.post("/v1/documents", json={"documents": DOCS}, headers={"Authorization": "Bearer shared"})
        assert r.status_code == 201, r.text
        q = {"question": "What is the capital of France?", "max_tokens": 1, "top_k": 2, "recompute_ratio": 0.3}

        def stats(key: str, **extra) -> tuple[int, int]:
            s = c.post("/v1/query", json={**q, **extra}, headers={"Authorization": f"Bearer {key}"}).json()["stats"]
            stored_after_answers(c)  # what it missed is stored before the next request plans
            return s["cache_hits"], s["cache_misses"]

        chunks = 1 + 2 + 2  # the system prefix, two markers, two passages
        assert stats("shared") == (chunks, 0)  # the default namespace: what ingestion stored
        assert stats("acme-key") == (0, chunks)  # acme sees none of it...
        assert stats("acme-key") == (chunks, 0)  # ...then its own
        assert stats("g-key") == (0, chunks)  # and globex not acme's
        assert stats("shared", cache_salt="s1") == (0, chunks)  # a salt is a namespace of its own
        assert stats("shared", cache_salt="s1") == (chunks, 0)
        assert stats("acme-key", cache_salt="s1") == (0, chunks)  # per tenant, too
        assert stats("shared") == (chunks, 0)  # and the default one is as it was
