"""blendserve_vllm.segments: the shared-memory segment format, its names, and the publisher's budget;
blend_engine.executor.kv_export, which fills a segment from a request's KVCache."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict

import numpy as np
import pytest
import torch

from blend_engine.executor.kv_export import export
from blend_engine.executor.layers import KVCache
from blendserve_vllm.segments import (
    HEADER_BYTES,
    MAGIC,
    Segment,
    SegmentError,
    SegmentMeta,
    SegmentPublisher,
    check_name,
    fill_buffer,
    release,
    token_hash,
    write_segment,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_meta(L: int = 2, T: int = 3, H: int = 2, D: int = 4, dtype: str = "float32",
              ids: list[int] | None = None) -> SegmentMeta:
    ids = list(range(T)) if ids is None else ids
    return SegmentMeta(n_layers=L, n_tokens=T, kv_heads=H, head_dim=D, dtype=dtype, token_hash=token_hash(ids))


def random_kv(meta: SegmentMeta, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer K, V [T, H, D] in the meta's dtype, distinct per layer and per half."""
    g = torch.Generator().manual_seed(seed)
    shape = (meta.n_tokens, meta.kv_heads, meta.head_dim)
    dt = getattr(torch, meta.dtype)
    ks = [torch.randn(shape, generator=g).to(dt) for _ in range(meta.n_layers)]  # L x [T, H, D]
    vs = [torch.randn(shape, generator=g).to(dt) for _ in range(meta.n_layers)]  # L x [T, H, D]
    return ks, vs


def write(folder, name: str, meta: SegmentMeta, seed: int = 0):
    ks, vs = random_kv(meta, seed)

    def fill(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k.copy_(ks[layer])
        v.copy_(vs[layer])

    return write_segment(folder, name, meta, fill), ks, vs


# ------------------------------------------------------------------ write / open
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_then_open_round_trips_every_layer(tmp_path, dtype):
    meta = make_meta(L=3, T=5, H=2, D=4, dtype=str(dtype).removeprefix("torch."))
    path, ks, vs = write(tmp_path, "seg-1", meta)
    assert path == tmp_path / "seg-1"
    assert os.path.getsize(path) == HEADER_BYTES + 3 * 2 * 5 * 2 * 4 * dtype.itemsize
    assert sorted(os.listdir(tmp_path)) == ["seg-1"]  # no temp file left behind

    seg = Segment.open(tmp_path, "seg-1")
    try:
        assert seg.meta == meta
        for layer in range(3):
            assert seg.k(layer).dtype == dtype and seg.k(layer).shape == (5, 2, 4)
            assert torch.equal(seg.k(layer), ks[layer])
            assert torch.equal(seg.v(layer), vs[layer])
    finally:
        seg.close()
    assert Segment.read_meta(tmp_path, "seg-1") == meta


def test_an_opened_segment_is_a_private_copy(tmp_path):
    """A reader writing into its views changes nothing on disk (MAP_PRIVATE)."""
    meta = make_meta()
    _, ks, _ = write(tmp_path, "seg", meta)
    seg = Segment.open(tmp_path, "seg")
    seg.k(0).fill_(7.0)
    seg.close()
    again = Segment.open(tmp_path, "seg")
    try:
        assert torch.equal(again.k(0), ks[0])
    finally:
        again.close()


def test_a_fill_that_raises_leaves_no_file(tmp_path):
    meta = make_meta(L=3)

    def fill(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == 1:
            raise RuntimeError("copy failed")
        k.fill_(1.0)

    with pytest.raises(RuntimeError, match="copy failed"):
        write_segment(tmp_path, "seg", meta, fill)
    assert os.listdir(tmp_path) == []
    with pytest.raises(SegmentError, match="gone"):
        Segment.read_meta(tmp_path, "seg")


def test_write_refuses_a_bad_name_before_creating_anything(tmp_path):
    with pytest.raises(SegmentError):
        write_segment(tmp_path, "../escape", make_meta(), lambda *a: None)
    assert os.listdir(tmp_path) == [] and not (tmp_path.parent / "escape").exists()


# ------------------------------------------------------------------ names
@pytest.mark.parametrize("name", ["blendserve-0123456789abcdef-42-0", "a", "A.b_c-9", "x" * 128])
def test_check_name_accepts_bare_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", [
    "a/b", "/etc/passwd", "../etc", "..", "a..b", "seg/..", "", ".hidden", ".seg.tmp", "-x", "a b",
    "x" * 129, None, 5, b"abc", ["a"],
], ids=repr)
def test_check_name_refuses_paths_and_junk(name):
    with pytest.raises(SegmentError, match="bad segment handle"):
        check_name(name)


def test_check_name_refuses_a_trailing_newline():
    with pytest.raises(SegmentError):
        check_name("abc\n")


# ------------------------------------------------------------------ gone, torn, foreign files
@pytest.mark.parametrize("reader", ["read_meta", "open"])
def test_a_gone_segment_is_a_segment_error(tmp_path, reader):
    with pytest.raises(SegmentError, match="gone"):
        getattr(Segment, reader)(tmp_path, "nothing-here")


TORN_SIZES = {  # the file cut (or grown) to: its size given the complete segment's
    "empty": lambda n: 0,
    "inside-magic": lambda n: 6,
    "inside-meta": lambda n: 40,
    "header-only": lambda n: HEADER_BYTES,
    "one-short": lambda n: n - 1,
    "one-long": lambda n: n + 1,
}


@pytest.mark.parametrize("reader", ["read_meta", "open"])
@pytest.mark.parametrize("cut", list(TORN_SIZES))
def test_a_torn_segment_is_a_segment_error(tmp_path, reader, cut):
    meta = make_meta()
    path, _, _ = write(tmp_path, "seg", meta)
    os.truncate(path, TORN_SIZES[cut](meta.nbytes))
    with pytest.raises(SegmentError):
        getattr(Segment, reader)(tmp_path, "seg")


@pytest.mark.parametrize("reader", ["read_meta", "open"])
def test_bad_magic_is_a_segment_error(tmp_path, reader):
    meta = make_meta()
    path, _, _ = write(tmp_path, "seg", meta)
    with open(path, "r+b") as fh:
        fh.write(b"NOTBLEND")
    with pytest.raises(SegmentError, match="bad magic"):
        getattr(Segment, reader)(tmp_path, "seg")


def _raw_header(fields: dict) -> bytes:
    body = json.dumps(fields).encode()
    return (MAGIC + len(body).to_bytes(4, "little") + body).ljust(HEADER_BYTES, b"\0")


@pytest.mark.parametrize("fields", [
    {"n_layers": 1},  # missing fields
    {**asdict(make_meta()), "extra": 1},
    {**asdict(make_meta()), "dtype": "int8"},
    {**asdict(make_meta()), "n_tokens": 0},
], ids=["missing", "extra", "dtype", "zero-tokens"])
def test_an_unreadable_meta_is_a_segment_error(tmp_path, fields):
    (tmp_path / "seg").write_bytes(_raw_header(fields))
    with pytest.raises(SegmentError):
        Segment.read_meta(tmp_path, "seg")


def test_a_meta_of_wrong_types_is_a_segment_error(tmp_path):
    (tmp_path / "seg").write_bytes(_raw_header({**asdict(make_meta()), "n_layers": "2"}))
    with pytest.raises(SegmentError):
        Segment.read_meta(tmp_path, "seg")


# ------------------------------------------------------------------ in memory (the Redis path)
def test_from_buffer_reads_what_write_segment_wrote(tmp_path):
    meta = make_meta(L=3, T=5, dtype="bfloat16")
    path, ks, vs = write(tmp_path, "seg", meta)
    for buf in (bytearray(path.read_bytes()), memoryview(bytearray(path.read_bytes())), path.read_bytes()):
        seg = Segment.from_buffer("seg", buf)
        try:
            assert seg.meta == meta and seg.name == "seg" and seg.path is None
            for layer in range(3):
                assert torch.equal(seg.k(layer), ks[layer]) and torch.equal(seg.v(layer), vs[layer])
            seg.k(0).fill_(1.0)  # writable views, even over read-only bytes
        finally:
            seg.close()


def test_from_buffer_shares_the_buffer():
    meta = make_meta()
    buf = fill_buffer(meta, lambda layer, k, v: (k.fill_(layer), v.fill_(-layer)))
    assert len(buf) == meta.nbytes and bytes(buf[:HEADER_BYTES]) == meta.encode()
    seg = Segment.from_buffer("seg", buf)
    try:
        assert float(seg.v(1)[2, 1, 3]) == -1.0
        seg.k(1).fill_(5.0)
        start = HEADER_BYTES + meta.layer_nbytes  # layer 1's K
        assert torch.equal(torch.frombuffer(buf, dtype=torch.float32, offset=start, count=1), torch.tensor([5.0]))
    finally:
        seg.close()


@pytest.mark.parametrize("cut", list(TORN_SIZES))
def test_from_buffer_refuses_a_torn_segment(tmp_path, cut):
    meta = make_meta()
    path, _, _ = write(tmp_path, "seg", meta)
    data = path.read_bytes()
    buf = bytearray(data[:TORN_SIZES[cut](meta.nbytes)].ljust(TORN_SIZES[cut](meta.nbytes), b"\0"))
    with pytest.raises(SegmentError):
        Segment.from_buffer("seg", buf)


def test_a_fill_buffer_that_raises_propagates():
    def fill(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        fill_buffer(make_meta(), fill)


# ------------------------------------------------------------------ token hash
def test_token_hash_is_sha256_of_little_endian_int64():
    ids = [1, 2, 300000, 2**40]
    expected = hashlib.sha256(struct.pack("<4q", *ids)).hexdigest()
    assert token_hash(ids) == expected
    assert token_hash(tuple(ids)) == expected
    assert token_hash(np.array(ids)) == expected
    assert token_hash(np.array([1, 2, 3], dtype=np.int32)) == token_hash([1, 2, 3])


def test_token_hash_tells_ids_apart():
    hashes = {token_hash(ids) for ids in ([1, 2, 3], [1, 2, 4], [3, 2, 1], [1, 2], [1, 2, 3, 0], [])}
    assert len(hashes) == 6


# ------------------------------------------------------------------ publisher
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def publish(pub: SegmentPublisher, seed: int = 0, **kw):
    meta = make_meta(**kw)
    ks, vs = random_kv(meta, seed)

    def fill(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k.copy_(ks[layer])
        v.copy_(vs[layer])

    return pub.publish(meta, fill)


def test_publisher_writes_a_readable_segment(tmp_path):
    pub = SegmentPublisher(tmp_path, budget_bytes=1 << 20)
    meta = make_meta(ids=[5, 6, 7])
    rec = pub.publish(meta, lambda layer, k, v: (k.fill_(layer), v.fill_(-layer)))
    check_name(rec.name)
    assert rec.token_hash == meta.token_hash and rec.nbytes == meta.nbytes
    assert rec.name.startswith(f"blendserve-{meta.token_hash[:16]}-{os.getpid()}")
    # two publishers (two containers whose pids coincide) never name a segment alike
    assert SegmentPublisher(tmp_path).new_name(meta.token_hash) != SegmentPublisher(tmp_path).new_name(meta.token_hash)
    seg = Segment.open(tmp_path, rec.name)
    try:
        assert float(seg.k(1)[0, 0, 0]) == 1.0 and float(seg.v(1)[0, 0, 0]) == -1.0
    finally:
        seg.close()
    assert publish(pub).name != rec.name


def test_publisher_evicts_the_oldest_first_by_bytes(tmp_path):
    one = make_meta().nbytes
    pub = SegmentPublisher(tmp_path, budget_bytes=2 * one + one // 2, clock=FakeClock())
    a, b = publish(pub), publish(pub)
    assert pub.stats() == {"segments": 2, "bytes": 2 * one, "published": 2, "evicted": 0, "expired": 0}
    c = publish(pub)
    assert not (tmp_path / a.name).exists()
    assert (tmp_path / b.name).exists() and (tmp_path / c.name).exists()
    d = publish(pub)
    assert not (tmp_path / b.name).exists() and (tmp_path / d.name).exists()
    assert pub.stats() == {"segments": 2, "bytes": 2 * one, "published": 4, "evicted": 2, "expired": 0}


def test_publisher_evicts_several_to_fit_a_larger_segment(tmp_path):
    small = make_meta(T=2).nbytes
    pub = SegmentPublisher(tmp_path, budget_bytes=3 * small)
    olds = [publish(pub, T=2) for _ in range(3)]
    big = publish(pub, T=5)  # larger than one small segment: two of the three must go
    live = [r.name for r in olds if (tmp_path / r.name).exists()]
    assert live == [olds[2].name] and (tmp_path / big.name).exists()
    assert pub.stats()["bytes"] == small + big.nbytes <= 3 * small


def test_publisher_expires_segments_older_than_ttl(tmp_path):
    clock = FakeClock()
    pub = SegmentPublisher(tmp_path, budget_bytes=1 << 20, ttl_s=10.0, clock=clock)
    a = publish(pub)
    clock.now += 5
    b = publish(pub)
    clock.now += 5  # a is exactly ttl old: kept
    pub.sweep()
    assert (tmp_path / a.name).exists()
    clock.now += 1
    pub.sweep()
    assert not (tmp_path / a.name).exists() and (tmp_path / b.name).exists()
    assert pub.stats() == {"segments": 1, "bytes": b.nbytes, "published": 2, "evicted": 0, "expired": 1}
    clock.now += 10
    publish(pub)  # publishing sweeps too
    assert not (tmp_path / b.name).exists()
    assert pub.stats()["expired"] == 2


def test_sweep_forgets_segments_another_process_freed(tmp_path):
    one = make_meta().nbytes
    pub = SegmentPublisher(tmp_path, budget_bytes=2 * one)
    a, b = publish(pub), publish(pub)
    os.unlink(tmp_path / a.name)  # vLLM's connector freed it after loading
    pub.sweep()
    assert pub.stats() == {"segments": 1, "bytes": one, "published": 2, "evicted": 0, "expired": 0}
    c = publish(pub)  # fits beside b: nothing evicted
    assert (tmp_path / b.name).exists() and (tmp_path / c.name).exists()
    assert pub.stats()["evicted"] == 0


def test_close_frees_every_segment(tmp_path):
    pub = SegmentPublisher(tmp_path, budget_bytes=1 << 20)
    for seed in range(3):
        publish(pub, seed)
    (tmp_path / "not-ours").write_bytes(b"x")
    pub.close()
    assert os.listdir(tmp_path) == ["not-ours"]
    assert pub.stats()["segments"] == 0 and pub.stats()["bytes"] == 0


def test_a_segment_over_the_budget_is_refused(tmp_path):
    meta = make_meta()
    pub = SegmentPublisher(tmp_path, budget_bytes=meta.nbytes - 1)
    with pytest.raises(SegmentError, match="budget"):
        pub.publish(meta, lambda *a: None)
    assert os.listdir(tmp_path) == [] and pub.stats()["published"] == 0
    assert SegmentPublisher(tmp_path, budget_bytes=meta.nbytes).publish(meta, lambda *a: None).nbytes == meta.nbytes


def test_publisher_needs_an_existing_folder(tmp_path):
    with pytest.raises(SegmentError, match="does not exist"):
        SegmentPublisher(tmp_path / "missing")


# ------------------------------------------------------------------ kv_export
def make_cache(L: int = 2, H: int = 2, C: int = 8, D: int = 4, dtype=torch.float32, length: int = 6) -> KVCache:
    g = torch.Generator().manual_seed(1)
    cache = KVCache(L, H, C, D, dtype, "cpu")
    for layer in range(L):
        cache.k[layer].copy_(torch.randn(H, C, D, generator=g))  # [H, C, D]
        cache.v[layer].copy_(torch.randn(H, C, D, generator=g))  # [H, C, D]
    cache.length = length
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_export_copies_the_first_t_positions_token_major(tmp_path, dtype):
    cache = make_cache(dtype=dtype)
    ids = [11, 12, 13, 14, 15]
    pub = SegmentPublisher(tmp_path, budget_bytes=1 << 20)
    out = export(cache, ids, pub)
    assert out.n_tokens == 5 and pub.stats()["segments"] == 1
    seg = Segment.open(tmp_path, out.handle)
    try:
        assert seg.meta == SegmentMeta(n_layers=2, n_tokens=5, kv_heads=2, head_dim=4,
                                       dtype=str(dtype).removeprefix("torch."), token_hash=token_hash(ids))
        assert out.nbytes == seg.meta.nbytes == os.path.getsize(tmp_path / out.handle)
        for layer in range(2):
            assert torch.equal(seg.k(layer), cache.k[layer][:, :5].transpose(0, 1))  # [T, H, D]
            assert torch.equal(seg.v(layer), cache.v[layer][:, :5].transpose(0, 1))  # [T, H, D]
    finally:
        seg.close()


def test_export_refuses_more_tokens_than_the_cache_holds(tmp_path):
    cache = make_cache(length=4)
    pub = SegmentPublisher(tmp_path, budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="holds 4 positions"):
        export(cache, [1, 2, 3, 4, 5], pub)
    assert os.listdir(tmp_path) == [] and pub.stats()["published"] == 0
    assert export(cache, [1, 2, 3, 4], pub).n_tokens == 4


# ------------------------------------------------------------------ released segments reused
def _published(pub: SegmentPublisher, seed: int, **kw):
    """Publish a segment; (its record, its K and V per layer)."""
    meta = make_meta(**kw)
    ks, vs = random_kv(meta, seed)

    def fill(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k.copy_(ks[layer])
        v.copy_(vs[layer])

    return pub.publish(meta, fill), ks, vs


def _reads_back(folder, name: str, ks, vs) -> bool:
    seg = Segment.open(folder, name)
    try:
        return all(torch.equal(seg.k(i), k) and torch.equal(seg.v(i), v) for i, (k, v) in enumerate(zip(ks, vs)))
    finally:
        seg.close()


@pytest.mark.parametrize("T", [64, 40, 200])  # the same size, smaller, larger than the spare
def test_a_released_segments_file_is_reused_by_the_next_one(tmp_path, T):
    """The connector hands a loaded segment back (renamed to a spare); the publisher's next segment
    takes that file's pages (the same inode) instead of a new file's, and reads back exactly."""
    pub = SegmentPublisher(tmp_path, budget_bytes=1 << 24)
    first, _, _ = _published(pub, 0, L=3, T=64, H=2, D=8)
    assert release(tmp_path, first.name) and not (tmp_path / first.name).exists()
    spare = tmp_path / (".spare-" + first.name)
    inode = spare.stat().st_ino
    pub.sweep()  # the first is gone for the publisher too
    assert pub.stats()["segments"] == 0
    second, ks, vs = _published(pub, 1, L=3, T=T, H=2, D=8)
    path = tmp_path / second.name
    assert path.stat().st_ino == inode and not spare.exists()
    assert path.stat().st_size == second.nbytes and _reads_back(tmp_path, second.name, ks, vs)
    assert release(tmp_path, "never-published") is False


def test_spares_are_bounded_kept_per_publisher_and_removed_on_close(tmp_path):
    from blendserve_vllm.segments import MAX_SPARES

    pub, other = SegmentPublisher(tmp_path, budget_bytes=1 << 24), SegmentPublisher(tmp_path, budget_bytes=1 << 24)
    records = [_published(pub, i)[0] for i in range(MAX_SPARES + 2)]
    theirs = _published(other, 9)[0]
    for rec in [*records, theirs]:
        release(tmp_path, rec.name)
    spares = lambda: sorted(n for n in os.listdir(tmp_path) if n.startswith(".spare-"))  # noqa: E731
    assert len(spares()) == MAX_SPARES + 3
    _published(pub, 20)  # takes one of its own, trims its own to MAX_SPARES
    assert len(spares()) == MAX_SPARES - 1 + 1  # its own left after the reuse, and the other's
    pub.close()
    assert spares() == [".spare-" + theirs.name]  # another publisher's spare is not touched
    other.close()
    assert spares() == []
