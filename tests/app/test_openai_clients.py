"""The official openai client and LangChain's ChatOpenAI against a real uvicorn server (a loopback
port, the real default model): conversations, streaming, n, stop, seed, /v1/completions, and the
400 for fields the server cannot honour."""

from __future__ import annotations

import httpx
import pytest

from app.main import create_app
from blendserve_config.stack import build_stack
from tests.helpers import make_settings, stored_after_answers
from tests.local_services import ThreadedServer

pytestmark = pytest.mark.slow

DOCS = [
    {"doc_id": "france", "title": "France", "text": "France is a country in Western Europe. Its capital is Paris."},
    {"doc_id": "japan", "title": "Japan", "text": "Japan is an island country in East Asia. Its capital is Tokyo."},
    {"doc_id": "kenya", "title": "Kenya", "text": "Kenya is a country in East Africa. Its capital is Nairobi."},
]
FIXED = {"recompute_ratio": 0.15, "top_k": 2}  # blend at a fixed ratio: the controller may pick full prefill


@pytest.fixture(scope="module")
def server(tmp_path_factory, real_runner, embedder, free_port):
    settings = make_settings(tmp_path_factory.mktemp("clients") / "data", request_timeout_s=300)
    app = create_app(settings, lambda s: build_stack(s, runner=real_runner, embedder=embedder))
    with ThreadedServer(app, free_port()) as srv:
        r = httpx.post(f"{srv.url}/v1/documents", json={"documents": DOCS}, timeout=120)
        assert r.status_code == 201, r.text
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)


def test_openai_client_a_conversation_and_its_stream(client, server):
    system = {"role": "system", "content": "Answer with the city only."}
    question = {"role": "user", "content": "And the capital of Japan?"}
    messages = [system, {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris"}, question]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                       extra_body={**FIXED, "explain": True})
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    blend = r.model_extra["blend"]
    turns = blend["explain"]["turns"]
    assert blend["turns"] == len(turns) == 2  # the first exchange is in the prompt, each message a segment
    # a follow-up: retrieval searched with the exchange before it, which made both passages come back
    assert blend["search"] == "What is the capital of France? Paris And the capital of Japan?"
    assert {s["doc_id"] for s in r.model_extra["sources"]} == {"france", "japan"}
    assert [s["index"] for s in r.model_extra["sources"]] == [1, 2]
    alone = client.chat.completions.create(model="m", messages=[system, question], max_tokens=1, temperature=0,
                                           extra_body={**FIXED, "documents": [  # the same passages, no history
                                               {"title": s["title"], "text": t} for s, t in zip(
                                                   r.model_extra["sources"], _texts(r.model_extra["sources"]))]})
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens + sum(t["n_tokens"] for t in turns)
    assert r.usage.prompt_tokens == blend["stats"]["context_tokens"]
    assert r.usage.prompt_tokens_details.cached_tokens == (blend["stats"]["context_tokens"]
                                                           - blend["stats"]["recomputed_tokens"]) > 0

    # the first answer queued the turns' KV for storing in the background; once stored, the same request
    # reads it from the cache (an exact repeat does not wait for it: its prefix is in the pool already)
    stored_after_answers(server)
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, extra_body=FIXED)
    assert again.model_extra["blend"]["stats"]["cache_misses"] == 0
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=FIXED))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == again.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == again.usage.completion_tokens


def _texts(sources: list[dict]) -> list[str]:
    by_id = {d["doc_id"]: d["text"] for d in DOCS}
    return [by_id[s["doc_id"]] for s in sources]


def test_openai_client_n_seed_and_stop(client):
    messages = [{"role": "user", "content": "Describe France."}]
    sampled = dict(model="m", messages=messages, max_tokens=12, temperature=1.0, seed=11, n=2, extra_body=FIXED)
    r = client.chat.completions.create(**sampled)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1] and texts[0] != texts[1]
    assert r.usage.completion_tokens > r.model_extra["blend"]["stats"]["completion_tokens"] > 0  # both choices
    assert [c.message.content for c in client.chat.completions.create(**sampled).choices] == texts  # the seed

    streamed = {0: "", 1: ""}
    for c in client.chat.completions.create(**sampled, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == texts

    full = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                          extra_body=FIXED).choices[0]
    stop = full.message.content.strip().split()[1]  # the second word of the unstopped answer
    cut = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0, stop=[stop, "zzz"],
                                         extra_body=FIXED).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full.message.content[:full.message.content.find(stop)]


def test_openai_client_completions(client):
    r = client.completions.create(model="m", prompt="Which city is the capital of Japan?", max_tokens=12,
                                  temperature=0, extra_body=FIXED)
    assert r.object == "text_completion" and "Tokyo" in r.choices[0].text
    assert r.model_extra["sources"][-1]["doc_id"] == "japan"  # best last, nearest the question
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt="Which city is the capital of Japan?", max_tokens=12, temperature=0, stream=True,
        extra_body=FIXED)
        if c.choices)
    assert streamed == r.choices[0].text


def test_unsupported_fields_are_a_400_naming_the_field(client):
    import openai

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for kwargs, field in [({"tools": [tool]}, "tools"), ({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"frequency_penalty": 0.5}, "frequency_penalty"), ({"extra_body": {"guided_json": {}}},
                                                                              "guided_json")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=messages, max_tokens=2, **kwargs)
        assert err.value.status_code == 400 and err.value.body["param"] == field and field in err.value.message
    # the neutral values change nothing and are accepted
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=2, response_format={"type": "text"},
                                       frequency_penalty=0, user="someone")
    assert r.choices[0].message.content is not None


def test_langchain_chat_openai(server):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="m", temperature=0, max_tokens=8,
                     timeout=300, extra_body=FIXED)
    conversation = [SystemMessage("Answer with the city only."), HumanMessage("What is the capital of Kenya?"),
                    AIMessage("Nairobi"), HumanMessage("And what is the capital of France?")]
    answer = llm.invoke(conversation)
    assert answer.content and answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0  # usage.prompt_tokens_details.cached_tokens
    cached = llm.invoke(conversation)  # the turns' KV is stored now: the same request reads it from the cache
    assert "".join(c.content for c in llm.stream(conversation)) == cached.content

    two = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="m", temperature=1.0, max_tokens=8, n=2,
                     seed=5, timeout=300, extra_body=FIXED).generate([conversation])
    assert len(two.generations[0]) == 2

    word = cached.content.strip()[:3]
    stopped = llm.invoke(conversation, stop=[word])
    assert word not in stopped.content and stopped.response_metadata["finish_reason"] == "stop"


def test_turn_three_recomputes_far_fewer_tokens_than_a_cold_prompt(client):
    """Each earlier message is a chunk of its own: turn 3 loads the passages and turn 1's exchange from
    the cache (turn 1's was stored after turn 2 first sent it) and recomputes the blend's share of
    them, plus turn 2's exchange (new) and the question."""
    messages = [{"role": "user", "content": "Which country has Tokyo as its capital?"}]
    stats = []
    for follow_up in ("And which country has Paris as its capital?", "Which of the two is an island country?", None):
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={**FIXED, "explain": True})
        blend = r.model_extra["blend"]
        stats.append(blend)
        if follow_up:
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": follow_up}]
    third = stats[2]
    turns = third["explain"]["turns"]
    assert third["turns"] == len(turns) == 4
    # turn 1's exchange reused; turn 2's question is new (its answer too, unless it repeats an earlier one)
    assert [t["cache"] for t in turns[:3]] == ["hit", "hit", "miss"], (messages, turns)
    cold = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={**FIXED, "mode": "full_prefill"}).model_extra["blend"]["stats"]
    n = third["stats"]["context_tokens"]
    assert cold["context_tokens"] == n and cold["recomputed_tokens"] == n  # the same prompt, cold: every token
    assert third["stats"]["recomputed_tokens"] < 0.5 * n, third["stats"]
    print(f"turn 3: {third['stats']['recomputed_tokens']} of {n} prompt tokens recomputed; cold: {n}")


def test_openai_client_logprobs_plain_streamed_and_legacy(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    asked = dict(model="m", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                 extra_body=FIXED)
    r = client.chat.completions.create(**asked)
    tokens = r.choices[0].logprobs.content
    assert len(tokens) == r.usage.completion_tokens and "".join(t.token for t in tokens).startswith(
        r.choices[0].message.content)
    for t in tokens:  # greedy: the chosen token is the most likely one
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and bytes(t.bytes).decode() == t.token
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    streamed = [t for c in client.chat.completions.create(**asked, stream=True) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in tokens]
    assert client.chat.completions.create(**{**asked, "logprobs": False, "top_logprobs": None}).choices[0].logprobs \
        is None

    legacy = client.completions.create(model="m", prompt="What is the capital of France?", max_tokens=6,
                                       temperature=0, logprobs=2, extra_body=FIXED).choices[0].logprobs
    assert legacy.tokens == [t.token for t in tokens]
    assert legacy.token_logprobs == pytest.approx([t.logprob for t in tokens], abs=1e-4)
    assert all(len(top) <= 2 for top in legacy.top_logprobs) and legacy.text_offset[0] == 0
    assert legacy.text_offset == sorted(legacy.text_offset)


def test_langchain_logprobs(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="m", temperature=0, max_tokens=6,
                     logprobs=True, top_logprobs=2, timeout=300, extra_body=FIXED)
    out = llm.invoke("What is the capital of France?")
    content = out.response_metadata["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) == 2 for t in content)
