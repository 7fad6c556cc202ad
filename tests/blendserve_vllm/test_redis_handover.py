"""blendserve_vllm.redis_handover and segments.RedisPublisher against a throwaway redis-server;
redis-py (the project's own client) reads back what the RESP2 client wrote, and writes what it reads."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from blendserve_vllm import redis_handover as rh
from blendserve_vllm.segments import HEADER_BYTES, RedisPublisher, SegmentError, token_hash
from tests.blendserve_vllm.conftest import needs_redis
from tests.blendserve_vllm.test_segments import FakeClock, make_meta, random_kv
from tests.local_services import free_port


def fill_from(ks: list[torch.Tensor], vs: list[torch.Tensor]):
    def fill(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k.copy_(ks[layer])
        v.copy_(vs[layer])

    return fill


def publish(pub: RedisPublisher, seed: int = 0, **kw):
    meta = make_meta(**kw)
    ks, vs = random_kv(meta, seed)
    return pub.publish(meta, fill_from(ks, vs)), ks, vs


def key_of(handle: str) -> str:
    return rh.segment_key(rh.redis_name(handle))


# ------------------------------------------------------------------ URLs and handles (no server)
@pytest.mark.parametrize("url, want", [
    ("redis://h", rh.RedisAddress("h", 6379, 0, None, None)),
    ("redis://127.0.0.1:7000/3", rh.RedisAddress("127.0.0.1", 7000, 3, None, None)),
    ("redis://:s3cret@h:1/", rh.RedisAddress("h", 1, 0, None, "s3cret")),
    ("redis://alice:p%40ss@h:2/15", rh.RedisAddress("h", 2, 15, "alice", "p@ss")),
])
def test_urls_parse(url, want):
    assert rh.RedisAddress.from_url(url) == want


@pytest.mark.parametrize("url", ["rediss://h:1", "http://h", "redis://", "redis://h:1/zero", "redis://h:99999",
                                 "h:6379"])
def test_bad_urls_are_redis_errors(url):
    with pytest.raises(rh.RedisError):
        rh.RedisAddress.from_url(url)


def test_a_logged_address_hides_the_password():
    assert str(rh.RedisAddress.from_url("redis://alice:s3cret@h:2/1")) == "redis://alice:***@h:2/1"
    assert "s3cret" not in str(rh.RedisAddress.from_url("redis://:s3cret@h"))


def test_handles_and_keys():
    assert rh.is_redis_handle("redis:blendserve-1") and not rh.is_redis_handle("blendserve-1")
    assert not rh.is_redis_handle(None) and not rh.is_redis_handle(["redis:x"])
    assert rh.redis_name("redis:blendserve-1") == "blendserve-1"
    assert rh.segment_key("blendserve-1") == "blendserve:segment:blendserve-1"
    for bad in ("redis:", "redis:../x", "redis:a b", "blendserve-1"):
        with pytest.raises(SegmentError):
            rh.redis_name(bad)


# ------------------------------------------------------------------ failures without a working server
def test_a_down_server_is_a_segment_error():
    client = rh.RedisClient(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
    with pytest.raises(SegmentError, match="unavailable"):
        client.ping()
    with pytest.raises(SegmentError):
        rh.read_meta(client, "blendserve-1")
    with pytest.raises(SegmentError):
        RedisPublisher(f"redis://127.0.0.1:{free_port()}/0").publish(make_meta(), lambda *a: None)


def test_a_server_that_never_answers_times_out():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (in the backlog), never replies
        client = rh.RedisClient(f"redis://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(SegmentError, match="timed out"):
            client.get("k")
        assert time.monotonic() - t0 < 5


def test_a_connection_dropped_mid_reply_is_a_segment_error():
    with socket.create_server(("127.0.0.1", 0)) as server:
        def serve() -> None:
            conn, _ = server.accept()
            conn.recv(1024)
            conn.sendall(b"$100\r\nonly-part")  # a bulk reply cut short
            conn.close()

        thread = threading.Thread(target=serve)
        thread.start()
        client = rh.RedisClient(f"redis://127.0.0.1:{server.getsockname()[1]}", timeout_s=5)
        with pytest.raises(SegmentError, match="mid-reply"):
            client.get("k")
        thread.join(5)


# ------------------------------------------------------------------ the client on a real server
@needs_redis
def test_binary_values_round_trip_both_ways(redis_server, raw):
    client = rh.RedisClient(redis_server.url)
    small = bytes(range(256)) * 3 + b"\r\n$-1\r\n*0\r\n"
    big = torch.randint(0, 256, (5 << 20,), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    big_bytes = big.numpy().tobytes()
    client.set("small", small)
    client.set("big", memoryview(big.numpy()))  # sent from the tensor's own memory
    assert raw.get("small") == small and raw.get("big") == big_bytes
    raw.set("theirs", big_bytes[:3_000_001])
    got = client.get("theirs")
    assert isinstance(got, bytearray) and got == big_bytes[:3_000_001]
    assert client.get("missing") is None
    assert client.getrange("small", 0, 3) == bytes(range(4))
    assert client.getrange("missing", 0, 3) == b""
    assert client.head("big", 16) == (big_bytes[:16], 5 << 20)


@needs_redis
def test_exists_delete_and_expiry(redis_server, raw):
    client = rh.RedisClient(redis_server.url)
    client.set("a", b"1", ex_s=30)
    client.set("b", b"2")
    assert 0 < raw.ttl("a") <= 30 and raw.ttl("b") == -1
    assert client.exists("a") and not client.exists("zzz")
    assert client.exists_each(["a", "zzz", "b"]) == [True, False, True]
    assert client.delete("a", "zzz") == 1 and not raw.exists("a")
    assert client.delete() == 0


@needs_redis
def test_an_error_reply_is_a_segment_error_and_the_connection_stays_usable(redis_server, raw):
    raw.hset("a-hash", "f", "v")
    client = rh.RedisClient(redis_server.url)
    with pytest.raises(SegmentError, match="WRONGTYPE"):
        client.head("a-hash", 16)  # both pipelined replies are errors: both read
    client.set("k", b"v")
    assert client.get("k") == b"v"


@needs_redis
def test_a_connection_the_server_dropped_is_reopened_once(redis_server, raw):
    client = rh.RedisClient(redis_server.url)
    assert client.ping()
    raw.client_kill_filter(_type="normal", skipme=True)  # every connection but redis-py's own
    assert client.ping()


@needs_redis
def test_a_stopped_server_is_a_segment_error(redis_server):
    client = rh.RedisClient(redis_server.url, timeout_s=1.0)
    assert client.ping()
    redis_server.stop()
    with pytest.raises(SegmentError):
        client.get("k")


@needs_redis
def test_password_and_database_come_from_the_url(redis_server, raw):
    raw.config_set("requirepass", "s3cret")
    port = redis_server.port
    try:
        with pytest.raises(SegmentError, match="NOAUTH|Authentication"):
            rh.RedisClient(f"redis://127.0.0.1:{port}/0").get("k")
        with pytest.raises(SegmentError, match="refused the login"):
            rh.RedisClient(f"redis://:wrong@127.0.0.1:{port}/0").get("k")
        client = rh.RedisClient(f"redis://:s3cret@127.0.0.1:{port}/3")
        client.set("k", b"in-db-3")
        import redis

        db3, db0 = (redis.Redis(port=port, password="s3cret", db=db) for db in (3, 0))
        assert db3.get("k") == b"in-db-3" and db0.get("k") is None
        db0.execute_command("ACL", "SETUSER", "alice", "on", ">p@ss", "~*", "+@all")
        assert rh.RedisClient(f"redis://alice:p%40ss@127.0.0.1:{port}/3").get("k") == b"in-db-3"
    finally:
        redis.Redis(port=port, password="s3cret").config_set("requirepass", "")


# ------------------------------------------------------------------ segments through Redis
@needs_redis
def test_a_multi_megabyte_segment_round_trips(redis_server, raw):
    pub = RedisPublisher(redis_server.url, budget_bytes=64 << 20, ttl_s=60)
    meta = make_meta(L=4, T=512, H=8, D=64, dtype="float32")  # 8 MiB of K and V
    ks, vs = random_kv(meta)
    rec = pub.publish(meta, fill_from(ks, vs))
    assert rec.name.startswith(f"redis:blendserve-{meta.token_hash[:16]}-") and rec.nbytes == meta.nbytes
    key = key_of(rec.name)
    assert key == "blendserve:segment:" + rec.name.removeprefix("redis:")
    assert raw.strlen(key) == meta.nbytes and raw.getrange(key, 0, 7) == b"BLENDKV1"
    assert 0 < raw.ttl(key) <= 60

    reader = rh.RedisClient(redis_server.url)
    assert rh.read_meta(reader, rh.redis_name(rec.name)) == meta
    seg = rh.open_segment(reader, rh.redis_name(rec.name))
    try:
        assert seg.meta == meta and seg.name == rh.redis_name(rec.name)
        for layer in range(meta.n_layers):
            assert torch.equal(seg.k(layer), ks[layer]) and torch.equal(seg.v(layer), vs[layer])
    finally:
        seg.close()
    assert rh.free(reader, [rh.redis_name(rec.name)]) == 1 and not raw.exists(key)
    assert rh.free(reader, [rh.redis_name(rec.name)]) == 0


@needs_redis
def test_a_gone_or_torn_segment_is_a_segment_error(redis_server, raw):
    client = rh.RedisClient(redis_server.url)
    for read in (rh.read_meta, rh.open_segment):
        with pytest.raises(SegmentError, match="gone"):
            read(client, "blendserve-none")
    meta = make_meta()
    raw.set(rh.segment_key("torn"), meta.encode() + b"\0" * (meta.nbytes - HEADER_BYTES - 1))
    with pytest.raises(SegmentError, match="torn"):
        rh.read_meta(client, "torn")
    with pytest.raises(SegmentError, match="holds"):
        rh.open_segment(client, "torn")
    raw.set(rh.segment_key("junk"), b"x" * 5000)
    with pytest.raises(SegmentError, match="bad magic"):
        rh.read_meta(client, "junk")


@needs_redis
def test_the_budget_counts_what_is_outstanding_and_evicts_the_oldest(redis_server, raw):
    one = make_meta().nbytes
    pub = RedisPublisher(redis_server.url, budget_bytes=2 * one + one // 2, clock=FakeClock())
    (a, _, _), (b, _, _) = publish(pub), publish(pub)
    assert pub.stats() == {"segments": 2, "bytes": 2 * one, "published": 2, "evicted": 0, "expired": 0}
    c, _, _ = publish(pub)
    assert not raw.exists(key_of(a.name)) and raw.exists(key_of(b.name)) and raw.exists(key_of(c.name))
    assert pub.stats() == {"segments": 2, "bytes": 2 * one, "published": 3, "evicted": 1, "expired": 0}
    raw.delete(key_of(b.name))  # vLLM's connector loaded it
    d, _, _ = publish(pub)  # fits beside c: nothing evicted
    assert raw.exists(key_of(c.name)) and raw.exists(key_of(d.name))
    assert pub.stats() == {"segments": 2, "bytes": 2 * one, "published": 4, "evicted": 1, "expired": 0}


@needs_redis
def test_the_publisher_expires_and_closes(redis_server, raw):
    clock = FakeClock()
    pub = RedisPublisher(redis_server.url, budget_bytes=1 << 20, ttl_s=10.0, clock=clock)
    a, _, _ = publish(pub)
    assert 0 < raw.ttl(key_of(a.name)) <= 10
    clock.now += 11
    b, _, _ = publish(pub)  # publishing sweeps: a is older than ttl
    assert not raw.exists(key_of(a.name)) and raw.exists(key_of(b.name))
    assert pub.stats()["expired"] == 1 and pub.stats()["segments"] == 1
    raw.set("not-ours", b"x")
    pub.close()
    assert raw.keys("*") == [b"not-ours"] and pub.stats()["segments"] == 0


@needs_redis
def test_a_segment_over_the_budget_is_refused(redis_server, raw):
    meta = make_meta()
    pub = RedisPublisher(redis_server.url, budget_bytes=meta.nbytes - 1)
    with pytest.raises(SegmentError, match="budget"):
        pub.publish(meta, lambda *a: None)
    assert raw.keys("*") == [] and pub.stats()["published"] == 0


@needs_redis
def test_publisher_names_are_distinct_across_publishers(redis_server):
    h = token_hash([1, 2, 3])
    one, two = RedisPublisher(redis_server.url), RedisPublisher(redis_server.url)
    names = {one.new_name(h), one.new_name(h), two.new_name(h)}
    assert len(names) == 3 and all(rh.redis_name(n) for n in names)

