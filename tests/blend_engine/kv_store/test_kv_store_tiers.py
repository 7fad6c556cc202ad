"""Codec, memory tier and tier composition: bit-exact round trips, int8 error, LRU, promotion."""

from __future__ import annotations

import functools

import pytest
import torch

from blend_engine.kv_store import ChunkKV, MemoryStore
from blend_engine.kv_store.codec import ChunkMeta, decode_chunk, encode_chunk, layer_nbytes
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.factory import build_store
from blend_engine.kv_store.tiered import TieredStore
from tests import helpers

make_kv = functools.partial(helpers.make_kv, L=3, T=7)


@pytest.mark.parametrize("fmt,dtype", [("fp16", torch.float16), ("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_float_codecs_are_bit_exact(fmt, dtype):
    kv = make_kv(1, dtype=dtype)
    meta, blobs = encode_chunk(fmt, kv)
    back = decode_chunk(meta, blobs)
    assert back.k.dtype == dtype and torch.equal(back.k, kv.k) and torch.equal(back.v, kv.v)
    assert len(blobs[0]) == layer_nbytes(fmt, 2, 7, 8) == meta.layer_nbytes


def test_int8_is_half_the_bytes_and_close():
    kv = make_kv(2, T=64, D=64, dtype=torch.float32)
    meta, blobs = encode_chunk("int8", kv)
    back = decode_chunk(meta, blobs)
    fp16 = layer_nbytes("fp16", 2, 64, 64)
    assert len(blobs[0]) == fp16 // 2 + 2 * 2 * 64 + 2 * 2 * 64  # int8 values + fp16 scales: K [H, D], V [H, T]
    # K per channel (over the chunk's tokens), V per token: error at most half a step of that scale
    k_step = kv.k.abs().amax(dim=2, keepdim=True) / 127  # [L, H, 1, D]
    v_step = kv.v.abs().amax(dim=-1, keepdim=True) / 127  # [L, H, T, 1]
    assert ((back.k - kv.k).abs() <= k_step * 0.5 + 1e-3).all()
    assert ((back.v - kv.v).abs() <= v_step * 0.5 + 1e-3).all()
    assert not torch.equal(back.k, kv.k)


def test_int8_keys_keep_small_channels_beside_an_outlier_channel():
    kv = make_kv(5, T=32, D=16, dtype=torch.float32)
    k = kv.k.clone()
    k[..., 3] *= 100.0  # an outlier channel, as real keys have
    back = decode_chunk(*encode_chunk("int8", ChunkKV(k, kv.v)))
    small = [d for d in range(16) if d != 3]
    err = (back.k[..., small] - k[..., small]).abs().max()
    assert err < 0.02  # a per-token scale would be ~100x coarser here: steps of max|k| / 127 ~ 2


def test_meta_json_round_trip_and_validation():
    meta, _ = encode_chunk("fp16", make_kv(3), fingerprint="fp-x")
    assert ChunkMeta.from_json(meta.to_json()) == meta
    with pytest.raises(ValueError):
        ChunkMeta("fp8", 1, 1, 1, 1, (0,))
    with pytest.raises(ValueError):
        ChunkMeta("fp16", 2, 1, 1, 1, (0,))


@pytest.mark.parametrize("fmt", ["fp16", "fp32", "int8"])
def test_memory_round_trip_per_layer(fmt):
    store = MemoryStore(1 << 20, kv_format=fmt)
    kv = make_kv(4, dtype=torch.float32)
    assert store.put("a", kv)
    expected = decode_chunk(*encode_chunk(fmt, kv))
    for layer in range(kv.n_layers):
        k, v = store.get_layer("a", layer)  # [H, T, D]
        assert torch.equal(k, expected.k[layer]) and torch.equal(v, expected.v[layer])
    assert store.get_layer("a", 3) is None and store.get_layer("b", 0) is None


def test_memory_evicts_least_recently_used_under_budget():
    one = encode_chunk("fp16", make_kv(0))[0].nbytes
    store = MemoryStore(3 * one, kv_format="fp16")
    for key in "abc":
        assert store.put(key, make_kv(ord(key)))
    assert store.get_layer("a", 0) is not None  # a becomes most recent
    assert store.put("d", make_kv(9))
    assert store.keys() == ["c", "a", "d"]  # b was the least recently used
    assert store.stats().evictions == 1 and store.stats().bytes_used == 3 * one
    assert not store.put("huge", make_kv(1, T=100))  # bigger than the whole budget: skipped
    assert store.stats().skipped_puts == 1 and store.keys() == ["c", "a", "d"]


def test_promotion_from_disk_to_memory_is_bit_exact(tmp_path):
    mem = MemoryStore(1 << 20, kv_format="int8")
    disk = DiskStore(tmp_path, 1 << 20, kv_format="int8")
    kv = make_kv(5, dtype=torch.float32)
    assert disk.put("k1", kv)  # only on disk
    tiers = TieredStore([mem, disk])
    from_disk = [tiers.get_layer("k1", i) for i in range(kv.n_layers)]
    assert mem.contains("k1")  # promoted after every layer passed through once
    assert tiers.stats().extra["promotions"] == 1
    for i, (k, v) in enumerate(from_disk):
        mk, mv = mem.get_layer("k1", i)
        assert torch.equal(mk, k) and torch.equal(mv, v)  # no re-quantization on the way up
    disk.delete("k1")
    assert torch.equal(tiers.get("k1").k, torch.stack([k for k, _ in from_disk]))


def test_partial_stream_does_not_promote(tmp_path):
    mem = MemoryStore(1 << 20)
    disk = DiskStore(tmp_path, 1 << 20)
    disk.put("k", make_kv(6))
    tiers = TieredStore([mem, disk])
    tiers.get_layer("k", 0)
    assert not mem.contains("k")
    assert tiers.get("k") is not None and mem.contains("k")  # a whole get promotes at once


def test_build_store_stacks_memory_over_disk(tmp_path):
    store = build_store(kv_format="fp16", memory_bytes=1 << 20, disk_dir=tmp_path / "kv", fingerprint="fp")
    assert [t.name for t in store.tiers] == ["memory", "disk"]
    kv = make_kv(7)
    assert store.put("x", kv)
    assert all(t.contains("x") for t in store.tiers)  # write-through
    assert torch.equal(store.get("x").k, kv.k)
    assert store.stats().extra["tiers"][1]["name"] == "disk"
    with pytest.raises(ValueError):
        TieredStore([MemoryStore(1, kv_format="fp16"), MemoryStore(1, kv_format="int8")])


def test_byte_lru_shared_by_memory_and_disk_tiers_keeps_order_sizes_and_counters():
    from blend_engine.kv_store.base import StoreStats
    from blend_engine.kv_store.lru import ByteLRU

    stats = StoreStats(name="t", bytes_budget=10)
    lru: ByteLRU[str] = ByteLRU(10, stats)
    for key, n in (("a", 4), ("b", 3), ("c", 2)):
        lru.add(key, n, key.upper())
    lru.touch("a")
    assert lru.keys() == ["b", "c", "a"] and (stats.bytes_used, stats.entries) == (9, 3)
    assert lru.evict_for(3) == ["b"] and lru.get("b") is None and lru.get("a") == "A"
    lru.add("a", 5, "A2")  # replacing an entry re-counts its size
    assert lru.keys() == ["c", "a"] and stats.bytes_used == 7
    assert not lru.fits(11) and lru.fits(10)
    assert lru.evict_bytes(1) == ["c"]  # at least 1 byte, oldest first, whatever the budget says
    assert lru.pop("a") == "A2" and lru.pop("a") is None
    assert (stats.bytes_used, stats.entries, stats.evictions, len(lru)) == (0, 0, 2, 0)
