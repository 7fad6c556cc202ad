"""Redis tier against a real redis-server on a free loopback port; Redis going away mid-run."""

from __future__ import annotations

import functools
import shutil
import time

import pytest
import redis
import torch

from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.codec import decode_chunk, encode_chunk
from blend_engine.kv_store.factory import build_store
from blend_engine.kv_store.redis_store import RedisStore, redact
from blend_engine.kv_store.tiered import TieredStore
from tests import helpers
from tests.helpers import poll
from tests.local_services import RedisProcess

REDIS = shutil.which("redis-server")
pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(REDIS is None, reason="redis-server binary not installed (apt-get install redis-server)"),
]


@pytest.fixture
def redis_server():
    server = RedisProcess().start()
    yield server
    server.stop()


make_kv = functools.partial(helpers.make_kv, T=11, dtype=torch.float32)


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_round_trip_bit_exact_and_layer_addressable(redis_server, fmt):
    store = RedisStore(redis_server.url, kv_format=fmt, fingerprint="fp")
    kv = make_kv(1)
    assert store.put("abc", kv)
    expected = decode_chunk(*encode_chunk(fmt, kv))
    for layer in (3, 0, 2):
        k, v = store.get_layer("abc", layer)  # [H, T, D]
        assert torch.equal(k, expected.k[layer]) and torch.equal(v, expected.v[layer])
    raw = redis.Redis.from_url(redis_server.url)
    assert sorted(raw.hkeys("blendserve:kv:abc")) == [b"0", b"1", b"2", b"3", b"meta"]
    assert store.stats().extra["available"] is True
    assert not RedisStore(redis_server.url, kv_format=fmt, fingerprint="other").contains("abc")


def test_corrupt_value_is_dropped(redis_server):
    store = RedisStore(redis_server.url)
    store.put("abc", make_kv(2))
    raw = redis.Redis.from_url(redis_server.url)
    blob = bytearray(raw.hget("blendserve:kv:abc", "1"))
    blob[5] ^= 0x10
    raw.hset("blendserve:kv:abc", "1", bytes(blob))
    assert store.get_layer("abc", 0) is not None
    assert store.get_layer("abc", 1) is None
    assert store.stats().corrupt == 1 and not store.contains("abc")


def test_two_replicas_share_through_redis(redis_server, tmp_path):
    a = build_store(disk_dir=tmp_path / "a", redis_url=redis_server.url, fingerprint="fp")
    b = build_store(disk_dir=tmp_path / "b", redis_url=redis_server.url, fingerprint="fp")
    kv = make_kv(3)
    assert a.put("shared", kv)
    assert [t.name for t in b.tiers] == ["memory", "disk", "redis"]
    assert b.contains("shared") and not b.tier("disk").contains("shared")
    got = [b.get_layer("shared", i) for i in range(kv.n_layers)]
    assert torch.equal(got[2][0], kv.k[2].half())
    assert b.tier("memory").contains("shared") and b.tier("disk").contains("shared")  # promoted on the way up


def test_redis_down_gives_misses_and_skipped_puts_not_errors(redis_server, caplog):
    store = RedisStore(redis_server.url, timeout_s=0.2, retry_after_s=0.3)
    store.put("abc", make_kv(4))
    redis_server.stop()
    t0 = time.perf_counter()
    assert store.get_layer("abc", 0) is None
    assert not store.contains("abc")
    assert store.put("xyz", make_kv(5)) is False
    assert time.perf_counter() - t0 < 2.0  # one timeout, then calls are skipped until the retry time
    st = store.stats()
    assert st.extra["available"] is False and st.errors >= 1 and st.skipped_puts == 1
    assert "unavailable" in caplog.text and "serving from local tiers" in caplog.text
    redis_server.start()  # same port, empty: reachable again after retry_after_s
    time.sleep(0.35)
    assert store.put("xyz", make_kv(5)) and store.available


def test_requests_still_succeed_when_redis_stops_mid_run(redis_server):
    """A blend engine over memory > Redis: Redis dies between (and during) requests; answers keep coming."""
    from blend_engine.types import BlendPlan, GenerationConfig
    from tests.blend_engine.kv_store.test_kv_engine import PASSAGES, QUESTION, engine_on, fingerprint

    fp = fingerprint()
    writer = engine_on(build_store(redis_url=redis_server.url, fingerprint=fp, redis_timeout_s=0.2))
    for p in PASSAGES:
        writer.ensure_cached(p)
    store = TieredStore([MemoryStore(1 << 26, fingerprint=fp),
                         RedisStore(redis_server.url, fingerprint=fp, timeout_s=0.2, retry_after_s=60)])
    eng = engine_on(store)
    plan = BlendPlan(passages=PASSAGES, question=QUESTION, recompute_ratio=0.3)
    gen = GenerationConfig(max_tokens=4)
    first = eng.run(plan, gen)
    assert first.report.cache_hits >= 3 and first.report.repaired_chunks == 0  # served from Redis
    store.tier("memory").delete(eng.key_of(eng.passage_tokens(PASSAGES[0])))  # forces a Redis read next time
    redis_server.stop()
    second = eng.run(plan, gen)
    assert second.token_ids == first.token_ids  # recomputed, stored in memory, same answer
    assert second.report.cache_misses >= 1
    assert store.stats().extra["redis_available"] is False
    # the recomputed passage is stored after the answer, in the background (an exact repeat would take its
    # KV from the pool meanwhile): once stored, a new request finds it in memory
    poll(lambda: eng.loop.stats()["store_queued"] == 0)
    third = eng.run(plan, gen)
    assert third.report.cache_misses == 0 and third.token_ids == first.token_ids


def test_redact_hides_passwords():
    assert redact("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"
