"""Staged layer streams: each chunk file opened once per stream, each layer blob read straight into
its staging region and verified (XXH3; older CRC32 files stay readable), the memory tier's blobs
handed over without a copy, the same values as a plain read."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib

import pytest
import torch

from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.codec import ChunkMeta, decode_chunk, encode_chunk
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.kv_store.staging import StagedLayer, StagingRing
from blend_engine.kv_store.tiered import TieredStore
from blend_engine.transfer import LayerPacker
from tests.helpers import make_kv

L = 4  # make_kv's layers


class Sink:
    """A pack callable with a staging ring: keeps a copy of each staged layer's blobs."""

    def __init__(self, gather: bool = False) -> None:
        self.staging = StagingRing(2, pinned=False, gather=gather)
        self.layers: list[StagedLayer] = []
        self.blobs: list[list[bytes]] = []

    def __call__(self, staged: StagedLayer) -> None:
        self.layers.append(staged)
        self.blobs.append([bytes(b) for b in staged.blobs])


def stream(store, keys, sink, depth=2, repair=None):
    s = LayerLoader(store, depth).stream(keys, L, repair or (lambda k: pytest.fail(f"repair of {k}")), pack=sink)
    try:
        list(s)
    finally:
        s.close()
    return s


def crc32_meta(meta: ChunkMeta, blobs) -> ChunkMeta:
    """The meta a chunk written before XXH3 had: CRC32 checksums and no `checksum` field in its JSON."""
    d = json.loads(dataclasses.replace(meta, checksums=tuple(zlib.crc32(b) for b in blobs), checksum="crc32").to_json())
    del d["checksum"]
    return ChunkMeta.from_json(json.dumps(d))


def test_new_chunks_use_xxh3_and_crc32_files_stay_readable_and_checked(tmp_path):
    kv = make_kv(1)
    meta, blobs = encode_chunk("fp16", kv)
    assert meta.checksum == "xxh3_64"
    old = crc32_meta(meta, blobs)
    assert old.checksum == "crc32" and old.verify(2, blobs[2]) and not meta.verify(2, blobs[2][:-1] + b"\0")
    store = DiskStore(tmp_path, 1 << 24)
    assert store.put_blobs("old", old, blobs)
    again = DiskStore(tmp_path, 1 << 24)  # the header is read back from the file
    assert again.meta("old").checksum == "crc32"
    assert torch.equal(again.get("old").k, decode_chunk(meta, blobs).k)
    path = again.path("old")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # last layer
    path.write_bytes(data)
    sink = Sink()
    s = stream(again, ["old"], sink, repair=lambda k: kv)
    assert s.trace.repaired == ["old"] and again.stats().corrupt == 1
    assert sink.blobs[0][0] == bytes(blobs[0])


@pytest.mark.parametrize("direct_io", [False, True])
def test_stream_opens_each_file_once_and_reads_each_layer_into_its_staging_region(tmp_path, monkeypatch, direct_io):
    store = DiskStore(tmp_path, 1 << 26, direct_io=direct_io)
    keys = ["a", "b", "c"]
    chunks = {k: encode_chunk("fp16", make_kv(i, T=9 + i)) for i, k in enumerate(keys)}
    for k, (meta, blobs) in chunks.items():
        store.put_blobs(k, meta, blobs)
    opened, reads = [], []
    real_open, real_preadv = os.open, os.preadv
    monkeypatch.setattr(os, "open", lambda p, *a, **kw: opened.append(str(p)) or real_open(p, *a, **kw))
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: reads.append(bufs[0]) or real_preadv(fd, bufs, off))
    sink = Sink()
    stream(store, keys, sink)
    assert sorted(p for p in opened if p.endswith(".kv")) == sorted(str(store.path(k)) for k in keys)  # once each
    assert len(reads) == L * len(keys)  # one read per chunk and layer, into the slot's regions
    for layer, staged in enumerate(sink.layers):
        for i, k in enumerate(keys):
            assert sink.blobs[layer][i] == bytes(chunks[k][1][layer])
            assert staged.slot.offset_of(staged.blobs[i]) is not None  # it lies in the staging slot
    assert store.stats().hits == len(keys) and store.stats().bytes_read == sum(m.nbytes for m, _ in chunks.values())


def test_memory_tier_blobs_are_views_of_one_tensor_per_chunk_handed_over_without_a_copy():
    store = MemoryStore(1 << 24, pinned=False)
    assert not store.pinned or torch.cuda.is_available()
    meta, blobs = encode_chunk("fp16", make_kv(2))
    source = [bytearray(b) for b in blobs]
    store.put_blobs("a", meta, source)
    source[1][0] ^= 0xFF  # the store copied: changing the caller's blob changes nothing stored
    assert bytes(store.get_blob("a", 1)[1]) == bytes(blobs[1])
    sink = Sink()
    stream(store, ["a"], sink)
    assert all(layer.slot.offset_of(layer.blobs[0]) is None for layer in sink.layers)  # the tier's own buffer
    gathered = Sink(gather=True)  # a consumer that wants one contiguous slot: copied in by the readers
    stream(store, ["a"], gathered)
    assert all(layer.slot.offset_of(layer.blobs[0]) is not None for layer in gathered.layers)
    assert gathered.blobs == sink.blobs == [[bytes(b)] for b in blobs]


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "int8"])
def test_packed_staged_layers_equal_the_unstaged_pack(tmp_path, fmt):
    """Memory over disk, one chunk in each tier: the packer's staged path (on the CPU one block
    gathered by numpy, cast and dequantized once) gives the same [H, Tc, D] blocks as packing the
    decoded layers."""
    disk = DiskStore(tmp_path, 1 << 26, kv_format=fmt)
    store = TieredStore([MemoryStore(1 << 26, kv_format=fmt), disk])
    store.put("m", make_kv(1, T=7))
    disk.put("d", make_kv(2, T=5))
    keys = ["m", "d"]
    staged = LayerLoader(store, 1).stream(keys, L, lambda k: pytest.fail(k), pack=LayerPacker("cpu", torch.float32, slots=3))
    plain = LayerLoader(store, 0).stream(keys, L, lambda k: pytest.fail(k), pack=None)
    try:
        for packed, layer_kv in zip(staged, plain):
            k, v = packed.wait()  # [H, Tc, D] each
            assert torch.equal(k, torch.cat([kc.float() for kc, _ in layer_kv], dim=1))
            assert torch.equal(v, torch.cat([vc.float() for _, vc in layer_kv], dim=1))
    finally:
        staged.close()
        plain.close()


class CountedPacker:
    """The CPU's packer, each layer's packing counted (`DispatchCount`): its torch ops and host reads."""

    def __init__(self) -> None:
        self.packer = LayerPacker("cpu", torch.float32)
        self.staging = self.packer.staging  # the loader reads into it
        self.ops: list[int] = []
        self.reads: list[str] = []

    def __call__(self, staged: StagedLayer):
        from blend_engine.executor.dispatch_count import DispatchCount

        with DispatchCount() as count:
            packed = self.packer(staged)
        self.ops.append(count.ops(None))
        self.reads += [r.what for r in count.host_reads(inside=False)]
        return packed


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "int8"])
def test_packing_a_staged_layer_costs_the_same_ops_for_3_and_30_chunks(tmp_path, fmt):
    """Issue #57: on the CPU the packer gathers every chunk's blob into one block by numpy (no torch
    op a chunk), some read from disk into the slot, the others handed over by the memory tier; the
    torch ops of each layer do not depend on the number of chunks, and none reads the host."""

    def packed(n: int) -> CountedPacker:
        disk = DiskStore(tmp_path / str(n), 1 << 26, kv_format=fmt)
        store = TieredStore([MemoryStore(1 << 26, kv_format=fmt), disk])
        keys = [f"c{i}" for i in range(n)]
        for i, key in enumerate(keys):
            (store if i % 2 else disk).put(key, make_kv(i, T=3 + i % 5))
        packer = CountedPacker()
        s = LayerLoader(store, 0).stream(keys, L, lambda k: pytest.fail(k), pack=packer)
        try:
            assert [p.wait()[0].shape[1] for p in s] == [sum(3 + i % 5 for i in range(n))] * L  # [H, Tc, D]
        finally:
            s.close()
        return packer

    few, many = packed(3), packed(30)
    assert few.ops == many.ops and few.reads == many.reads == [], (few.ops, many.ops, many.reads)


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_the_device_upload_of_a_staged_layer_equals_the_host_decode(tmp_path, fmt):
    """The CUDA path (`LayerPacker._upload`: one copy of the staging slot, per-chunk views of it
    concatenated, int8 scales stacked), run on the CPU: a chunk from RAM, one read from disk and
    one repaired mid-stream give the host decode's values bit for bit."""

    class Uploader(LayerPacker):
        def __call__(self, layer):
            return self._upload(layer)

    disk = DiskStore(tmp_path, 1 << 26, kv_format=fmt)
    store = TieredStore([MemoryStore(1 << 26, kv_format=fmt), disk])
    kvs = {"m": make_kv(1, T=7), "d": make_kv(2, T=5), "r": make_kv(3, T=3)}
    store.put("m", kvs["m"])
    for k in ("d", "r"):
        disk.put(k, kvs[k])
    path = disk.path("r")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # the last layer of "r" fails its checksum: repaired
    path.write_bytes(data)
    packer = Uploader("cpu", torch.float32, slots=4)
    packer.staging.gather = True  # as on CUDA: the readers copy pageable tier buffers into the slot
    keys = list(kvs)
    s = LayerLoader(store, 2).stream(keys, L, lambda k: kvs[k], pack=packer)
    expected = {k: decode_chunk(*encode_chunk(fmt, kv)) for k, kv in kvs.items()}
    try:
        for layer, packed in enumerate(s):
            k, v = packed.wait()  # [H, Tc, D] each
            assert (packed.scales is not None) == (fmt == "int8")
            assert torch.equal(k.float(), torch.cat([expected[x].k[layer].float() for x in keys], dim=1))
            assert torch.equal(v.float(), torch.cat([expected[x].v[layer].float() for x in keys], dim=1))
    finally:
        s.close()
    assert s.trace.repaired == ["r"]


def test_a_stream_from_disk_promotes_into_memory_only_where_the_chunk_fits(tmp_path):
    kv = make_kv(4)
    for budget, promoted in ((1 << 24, True), (0, False)):
        memory = MemoryStore(budget)
        disk = DiskStore(tmp_path / str(budget), 1 << 24)
        disk.put("a", kv)
        store = TieredStore([memory, disk])
        sink = Sink()
        stream(store, ["a"], sink)
        assert memory.contains("a") == promoted and store.stats().extra["promotions"] == int(promoted)
        assert memory.stats().skipped_puts == 0  # an empty memory tier is not offered what cannot fit
        if promoted:  # copied out of the reused staging slots: the promoted chunk is the stored one
            assert torch.equal(memory.get("a").k, decode_chunk(*encode_chunk("fp16", kv)).k)


def test_memory_hits_are_copied_in_on_the_streams_thread_while_disk_reads_go_through_the_pool(tmp_path, monkeypatch):
    """Per layer, a chunk the memory tier holds is taken on the stream's thread in one pass (no
    reader-pool task for it); chunks on disk are read by the pool. Same bytes either way."""
    import blend_engine.kv_store.loader as loader_mod

    disk = DiskStore(tmp_path, 1 << 26)
    store = TieredStore([MemoryStore(1 << 26), disk])
    kvs = {f"m{i}": make_kv(i, T=5 + i) for i in range(3)} | {f"d{i}": make_kv(10 + i, T=6) for i in range(3)}
    for k, kv in kvs.items():
        (store if k.startswith("m") else disk).put(k, kv)
    tasks: list[list[str]] = []
    real_pool = loader_mod.reader_pool()

    class CountingPool:
        def submit(self, fn, layer, group, slot):
            tasks.append([keys[i] for i in group])
            return real_pool.submit(fn, layer, group, slot)

    monkeypatch.setattr(loader_mod, "reader_pool", lambda: CountingPool())
    keys = ["m0", "d0", "m1", "d1", "m2", "d2"]
    gathered = Sink(gather=True)
    s = LayerLoader(store, 0).stream(keys, L, lambda k: pytest.fail(k), pack=gathered)  # no promotion mid-test
    list(s)
    s.close()
    pooled = {k for t in tasks for k in t}
    assert pooled and pooled <= {"d0", "d1", "d2"}  # memory hits never went to the pool
    assert len(s.trace.held_s) == L
    for layer, staged in enumerate(gathered.layers):
        assert all(staged.slot.offset_of(b) is not None for b in staged.blobs)  # all in the one slot
        assert gathered.blobs[layer] == [bytes(encode_chunk("fp16", kvs[k])[1][layer]) for k in keys]

    tasks.clear()
    only_memory = Sink(gather=True)
    s = LayerLoader(store, 2).stream(["m0", "m1", "m2"], L, lambda k: pytest.fail(k), pack=only_memory)
    list(s)
    s.close()
    assert tasks == []  # a layer held in memory needs no pool round trip at all
    assert only_memory.blobs[1] == [bytes(encode_chunk("fp16", kvs[k])[1][1]) for k in ("m0", "m1", "m2")]


def test_staging_memory_is_reused_by_the_next_ring_after_its_last_copy_out():
    """A request's ring gives its slots' buffers back when it goes; the next ring of similar
    sizes takes them (no fresh allocation, no page faults), after waiting for the copy out."""
    from blend_engine.kv_store.staging import HostBuffers, StagingSlot

    class Fence:
        waited = 0

        def synchronize(self):
            Fence.waited += 1

    buffers = HostBuffers(keep_bytes=64 << 20)
    first = StagingSlot([100_000, 200_000], pinned=False, buffers=buffers)
    address = first.buf.data_ptr()
    first.fence = Fence()
    assert buffers.allocated == 1 and buffers.free_bytes() == 0
    del first
    assert buffers.free_bytes() > 0
    second = StagingSlot([100_000, 190_000], pinned=False, buffers=buffers)  # a little smaller: fits
    assert buffers.allocated == 1 and second.buf.data_ptr() == address and Fence.waited == 1
    assert second.fence is None
    big = StagingSlot([8 << 20], pinned=False, buffers=buffers)  # does not fit the free ones: a new one
    assert buffers.allocated == 2 and big.buf.data_ptr() % 4096 == 0
    del second, big
    tiny = StagingSlot([10], pinned=False, buffers=buffers)  # takes the 1 MiB one...
    assert buffers.allocated == 2 and tiny.buf.data_ptr() == address
    tiny2 = StagingSlot([10], pinned=False, buffers=buffers)  # ...but a 9 MiB one is not wasted on 10 bytes
    assert buffers.allocated == 3 and tiny2.buf.numel() < (2 << 20)
    small_keep = HostBuffers(keep_bytes=1 << 20)
    for _ in range(3):
        StagingSlot([2 << 20], pinned=False, buffers=small_keep)
    assert small_keep.free_bytes() == 0  # more than it may keep: dropped


def test_a_buffer_given_back_while_its_pool_is_locked_does_not_deadlock():
    """A slot's finalizer gives its buffer back; the garbage collector runs it inside any allocation,
    also one `take` makes under the pool's lock on the same thread. That once hung the suite
    (HostBuffers.give waiting for the lock its own thread held, in test_fidelity and test_explain)."""
    import threading

    from blend_engine.kv_store.staging import HostBuffers

    buffers = HostBuffers(keep_bytes=64 << 20)
    lease = buffers.take(100_000, pinned=False)

    def give_under_the_lock():
        with buffers._lock:  # as inside `take`, when a collection runs a slot's finalizer
            buffers.give(lease)

    t = threading.Thread(target=give_under_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "give() waited for the lock its own thread holds"
    assert buffers.free_bytes() >= 100_000  # filed by the next call under the lock
    assert buffers.take(100_000, pinned=False) is lease and buffers.allocated == 1
