"""The service with BLENDSERVE_DECODER_KIND=vllm where vLLM cannot be reached (a closed port), on the
tiny model: readiness says why, queries get 503 with Retry-After and lose nothing the blend stored,
and what vLLM cannot do is refused before anything runs. Decoding on a real vLLM server:
tests/decoder_vllm/."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.settings import ServiceSettings
from app.vllm_decoder import VllmClient, vllm_salt
from blend_engine.types import BlendPlan, Mode
from retrieval.text import format_passage
from tests.helpers import make_settings, poll, svc

DOCS = [{"title": "Spree", "text": "Berlin lies on the Spree."}, {"title": "Seine", "text": "Paris lies on the Seine."}]


@pytest.fixture
def down_client(tmp_path, free_port, tiny_stack_factory):
    """The app with the vllm decoder pointed at a port nothing listens on, started (not ready)."""
    from app.main import create_app

    decoder = {"kind": "vllm", "vllm_url": f"http://127.0.0.1:{free_port()}", "segment_dir": tmp_path}
    settings = make_settings(tmp_path / "data", decoder=decoder, engine={"recompute_ratio": 0.15, "fidelity_gate": "off"})
    with TestClient(create_app(settings, tiny_stack_factory)) as client:
        poll(lambda: svc(client).ready)
        yield client


def test_kind_vllm_needs_a_url():
    with pytest.raises(ValidationError, match="BLENDSERVE_DECODER_VLLM_URL"):
        ServiceSettings(_env_file=None, decoder={"kind": "vllm"})
    with pytest.raises(ValidationError, match="http"):
        ServiceSettings(_env_file=None, decoder={"kind": "vllm", "vllm_url": "127.0.0.1:8001"})


def test_readyz_says_vllm_does_not_answer(down_client):
    r = down_client.get("/readyz")
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    body = r.json()
    assert body["status"] == "decoder_unavailable" and "does not answer" in body["reason"]


def test_a_query_gets_503_and_the_blend_still_stores_its_passages(down_client):
    client = down_client
    assert isinstance(svc(client).require_client(), VllmClient)
    r = client.post("/v1/query", json={"question": "Which river flows through Berlin?", "documents": DOCS,
                                       "mode": "blend", "max_tokens": 4})
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "decoder_unavailable"
    engine, store = svc(client).stack.engine, svc(client).stack.store
    keys = [engine.key_of(engine.passage_tokens(format_passage(d["text"], d["title"]))) for d in DOCS]
    # the blend ran and, as after any answer, stores the passages that missed: nothing is lost
    poll(lambda: all(store.contains(k) for k in keys) or None, timeout=60)


def test_explain_without_blendserves_prefill_is_a_400(down_client):
    r = down_client.post("/v1/query", json={"question": "Which river?", "documents": DOCS, "mode": "full_prefill",
                                            "explain": True})
    assert r.status_code == 400
    assert "explain" in r.json()["error"]["message"]


def test_vllm_prefix_cache_is_salted_by_tenant_and_kv_recipe():
    """Blended KV in vLLM's prefix cache never answers an exact mode, nor another tenant."""
    salts = {(salt, mode): vllm_salt(BlendPlan(("p",), "q", mode=mode, cache_salt=salt))
             for salt in (None, "tenant-a") for mode in Mode}
    assert salts[None, Mode.FULL_PREFILL] == salts[None, Mode.PREFIX_CACHE]  # both exact KV
    assert salts[None, Mode.BLEND] != salts[None, Mode.FULL_PREFILL]
    assert salts[None, Mode.FULL_REUSE] not in (salts[None, Mode.BLEND], salts[None, Mode.FULL_PREFILL])
    assert salts["tenant-a", Mode.BLEND] != salts[None, Mode.BLEND]


def test_the_blend_is_planned_once_off_the_event_loop_and_exact_modes_not_at_all(down_client, monkeypatch):
    """With the vllm decoder the engine plans a blend once, for its one token, on a worker thread;
    a full_prefill query (vLLM computes it) plans nothing on Blendserve's engine."""
    import asyncio

    engine = svc(down_client).stack.engine
    calls: list[tuple[int, str]] = []
    real = engine.prepare

    def spy(plan, max_new_tokens, layout=None):
        try:
            asyncio.get_running_loop()
            where = "event loop"
        except RuntimeError:
            where = "worker"
        calls.append((max_new_tokens, where))
        return real(plan, max_new_tokens, layout)

    monkeypatch.setattr(engine, "prepare", spy)
    query = {"question": "Which river flows through Paris?", "documents": DOCS, "max_tokens": 32}
    assert down_client.post("/v1/query", json=query | {"mode": "full_prefill"}).status_code == 503
    assert calls == []
    assert down_client.post("/v1/query", json=query | {"mode": "blend"}).status_code == 503
    assert calls == [(1, "worker")]
