"""The device hot tier (`kv_store.device`), run on "cpu" (real bytes) and "meta" (bookkeeping only):
put/get, LRU eviction by bytes, promotion of hot chunks from the memory and disk tiers, the budget
setting, and the packer leaving a device-resident chunk where it is (no upload)."""

from __future__ import annotations

import math

import pytest
import torch

from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.codec import decode_chunk, encode_chunk
from blend_engine.kv_store.device import AUTO_FRACTION, DeviceStore, device_cache_bytes
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.factory import build_store
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.kv_store.staging import reading_into
from blend_engine.kv_store.tiered import TieredStore
from blend_engine.transfer import LayerPacker
from tests.helpers import make_kv

L = 4  # make_kv's layers


def chunk_bytes(T: int = 9) -> int:
    return encode_chunk("fp16", make_kv(0, T=T))[0].nbytes


def run_stream(store, keys, pack, kvs=None, depth=1):
    s = LayerLoader(store, depth).stream(keys, L, (lambda k: kvs[k]) if kvs else (lambda k: pytest.fail(k)), pack=pack)
    try:
        out = list(s)
    finally:
        s.close()
    return out, s


class Keep:
    """A gathering consumer (as the CUDA packer is) that keeps each staged layer."""

    def __init__(self) -> None:
        from blend_engine.kv_store.staging import StagingRing

        self.staging = StagingRing(4, pinned=False, gather=True)

    def __call__(self, staged):
        return staged


def test_device_tier_round_trips_and_evicts_least_recently_used_by_bytes():
    size = chunk_bytes()
    store = DeviceStore(2 * size + size // 2, "cpu")  # room for two chunks
    kvs = {k: make_kv(i) for i, k in enumerate("abc")}
    for k in "ab":
        assert store.put(k, kvs[k])
    region = memoryview(bytearray(1))  # any staging target: in a layer stream the tier hands out device views
    with reading_into(region, None):
        got = [store.get_blob(k, 2) for k in ("a", "b", "x")]
    assert got[2] is None
    meta, blob = got[0]
    assert isinstance(blob, torch.Tensor) and blob.device.type == "cpu" and blob.dtype == torch.uint8
    assert bytes(blob.numpy()) == bytes(encode_chunk("fp16", kvs["a"])[1][2])  # a view of the stored bytes
    assert torch.equal(store.get("a").k, kvs["a"].k)  # the unstaged read copies back to the host
    store.get_blob("a", 0)  # a is used again: b is now the least recently used
    assert store.put("c", kvs["c"])
    assert store.keys() == ["a", "c"] and store.meta("b") is None
    s = store.stats()
    assert s.evictions == 1 and s.entries == 2 and s.bytes_used == 2 * size <= s.bytes_budget
    assert not store.put("big", make_kv(9, T=40)) and store.stats().skipped_puts == 1  # larger than the budget
    assert store.keys() == ["a", "c"]  # nothing evicted for a chunk that could never fit


def test_device_tier_bookkeeping_runs_on_the_meta_device_without_bytes():
    size = chunk_bytes()
    store = DeviceStore(3 * size, "meta")
    for i in range(5):
        assert store.put(f"k{i}", make_kv(i))
        assert store.stats().bytes_used <= 3 * size
    assert store.keys() == ["k2", "k3", "k4"] and store.stats().evictions == 2
    with reading_into(memoryview(bytearray(1)), None):
        meta, blob = store.get_blob("k3", 1)
    assert blob.device.type == "meta" and blob.numel() == meta.layer_nbytes
    assert store.can_hold(3 * size) and not store.can_hold(3 * size + 1)
    assert store.delete("k3") and store.keys() == ["k2", "k4"]
    with pytest.raises(ValueError):
        DeviceStore(-1, "meta")


def test_hot_chunks_move_up_into_the_device_tier_and_are_then_served_from_it(tmp_path):
    """Memory over disk under a device tier: a stream promotes a disk chunk into memory and device,
    a memory chunk into the device; the next stream gets both as device tensors."""
    device, memory = DeviceStore(1 << 24, "cpu"), MemoryStore(1 << 24, pinned=False)
    disk = DiskStore(tmp_path, 1 << 26)
    store = TieredStore([device, memory, disk])
    kvs = {"m": make_kv(1), "d": make_kv(2, T=5)}
    memory.put("m", kvs["m"])
    disk.put("d", kvs["d"])
    first, _ = run_stream(store, ["m", "d"], Keep())
    assert not any(isinstance(b, torch.Tensor) for staged in first for b in staged.blobs)
    assert set(device.keys()) == {"m", "d"} and memory.contains("d")
    assert store.stats().extra["promotions"] == 2
    second, _ = run_stream(store, ["m", "d"], Keep())
    for layer, staged in enumerate(second):
        assert all(isinstance(b, torch.Tensor) for b in staged.blobs)  # no host copy, no upload to come
        for k, b in zip(["m", "d"], staged.blobs):
            assert bytes(b.numpy()) == bytes(encode_chunk("fp16", kvs[k])[1][layer])
    assert device.stats().hits == 2 and store.stats().extra["promotions"] == 2


def test_a_device_tier_with_no_room_is_not_offered_promotions(tmp_path):
    device, memory = DeviceStore(0, "meta"), MemoryStore(1 << 24, pinned=False)
    store = TieredStore([device, memory])
    memory.put("m", make_kv(1))
    run_stream(store, ["m"], Keep())
    assert device.keys() == [] and device.stats().skipped_puts == 0 and store.stats().extra["promotions"] == 0


def _one_chunk_per_tier(tmp_path, fmt: str, device: str, pinned: bool | None = None):
    """A device, a memory and a disk tier holding chunk "g", "m" and "d" respectively: (store, their KV)."""
    tiers = [DeviceStore(1 << 24, device, kv_format=fmt), MemoryStore(1 << 24, kv_format=fmt, pinned=pinned),
             DiskStore(tmp_path, 1 << 26, kv_format=fmt)]
    kvs = {"g": make_kv(1, T=7), "m": make_kv(2, T=5), "d": make_kv(3, T=3)}
    for tier, key in zip(tiers, kvs):
        tier.put(key, kvs[key])
    return TieredStore(tiers), kvs


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_the_packer_uploads_nothing_for_a_chunk_already_on_the_device(tmp_path, fmt):
    """The CUDA upload path (`LayerPacker._upload`) on the CPU: a device-tier chunk is decoded where
    it lies; only the memory and disk chunks cross (counted), and the packed layer equals the host
    decode bit for bit."""

    class Uploader(LayerPacker):
        def __call__(self, layer):
            return self._upload(layer)

    store, kvs = _one_chunk_per_tier(tmp_path, fmt, "cpu", pinned=False)
    packer = Uploader("cpu", torch.float32, slots=4)
    packer.staging.gather = True  # as on CUDA
    keys = ["m", "g", "d"]
    expected = {k: decode_chunk(*encode_chunk(fmt, kv)) for k, kv in kvs.items()}
    packed, _ = run_stream(store, keys, packer, depth=0)  # depth 0: nothing promoted before layer L-1
    for layer, p in enumerate(packed):
        k, v = p.wait()  # [H, Tc, D] each
        assert torch.equal(k.float(), torch.cat([expected[x].k[layer].float() for x in keys], dim=1))
        assert torch.equal(v.float(), torch.cat([expected[x].v[layer].float() for x in keys], dim=1))
    moved = sum(encode_chunk(fmt, kvs[x])[0].layer_nbytes for x in ("m", "d")) * L
    assert packer.uploaded_bytes == moved  # the device chunk's bytes never crossed


def test_device_cache_budget_auto_explicit_and_bad_values(monkeypatch):
    assert device_cache_bytes(None, "cpu") == 0  # automatic: no device tier off CUDA
    assert device_cache_bytes(0, "cpu") == 0
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite number >= 0"):
            device_cache_bytes(bad, "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        device_cache_bytes(2.0, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    free, batch = 40 << 30, 2 << 30
    assert device_cache_bytes(None, "cuda:0", batch, free_bytes=free) == int(AUTO_FRACTION * (free - batch))
    assert device_cache_bytes(8.0, "cuda:0", batch, free_bytes=free) == 8 << 30
    with pytest.raises(ValueError, match="free on cuda:0"):
        device_cache_bytes(39.0, "cuda:0", batch, free_bytes=free)  # 39 + 2 GB of batch KV > 40 GB free


def test_build_store_puts_the_device_tier_on_top_and_settings_reject_bad_budgets(tmp_path):
    from pydantic import ValidationError

    from blendserve_config.settings import Settings
    from blendserve_config.stack import build_store_from

    store = build_store(device_bytes=1 << 20, device="meta", disk_dir=tmp_path)
    assert [t.name for t in store.tiers] == ["device", "memory", "disk"]
    assert [t.name for t in build_store().tiers] == ["memory"]
    with pytest.raises(ValueError, match="needs the device"):
        build_store(device_bytes=1 << 20)
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ValidationError):
            Settings(device_cache_gb=bad)
    assert Settings(device_cache_gb="").store.device_cache_gb is None
    cpu = Settings(data_dir=tmp_path, kv_format="fp16")
    assert [t.name for t in build_store_from(cpu, device="cpu").tiers] == ["memory", "disk"]  # automatic: none on the CPU
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_store_from(Settings(data_dir=tmp_path, kv_format="fp16", device_cache_gb=1.0), device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_on_cuda_a_device_tier_chunk_is_packed_in_place_next_to_uploaded_ones(tmp_path, fmt):
    """The real CUDA path: a device-tier chunk, a pinned memory-tier chunk and a disk chunk packed by
    the engine's packer on the copy stream equal the host decode; only the host chunks cross, and
    the upload's time reaches the store's counters."""
    store, kvs = _one_chunk_per_tier(tmp_path, fmt, "cuda")  # the memory tier pinned where CUDA exists
    packer = LayerPacker("cuda", torch.float16, slots=4)
    keys = ["m", "g", "d"]
    expected = {k: decode_chunk(*encode_chunk(fmt, kv)) for k, kv in kvs.items()}
    s = LayerLoader(store, 1).stream(keys, L, lambda k: pytest.fail(k), pack=packer)
    try:
        for layer, p in enumerate(s):
            k, v = p.wait()  # [H, Tc, D] each, on the device
            assert k.device.type == "cuda"
            assert torch.equal(k.float().cpu(), torch.cat([expected[x].k[layer].float() for x in keys], dim=1))
            assert torch.equal(v.float().cpu(), torch.cat([expected[x].v[layer].float() for x in keys], dim=1))
    finally:
        s.close()
    moved = sum(encode_chunk(fmt, kvs[x])[0].layer_nbytes for x in ("m", "d")) * L
    assert packer.uploaded_bytes == moved
    torch.cuda.synchronize()
    assert store.stats().extra.get("upload_bytes", 0) > 0
