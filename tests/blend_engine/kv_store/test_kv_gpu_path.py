"""The CUDA branches of the KV path, run on the CPU with a fake CUDA stream API (issue #39).

`fake_cuda` replaces torch.cuda's Stream, Event, stream(), current_stream() and
Tensor.record_stream by recorders: every stream operation, event and tensor copy lands in one log
in program order, each copy tagged with the stream it was queued on. The tensors are real CPU
tensors, so the values are checked too. What a test asserts is the ordering CUDA needs (a copy
stream waits for the stream whose memory it writes; an event recorded on the copy stream after the
copies, waited for by the consumer), the buffers kept alive until a copy's fence, the layers that
are read and the number of device ops per layer. Each test failed before its fix.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import blend_engine.kv_store.staging as staging_mod
from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.codec import decode_chunk, encode_chunk
from blend_engine.kv_store.device import DeviceStore
from blend_engine.kv_store.loader import CUDA_PREFETCH_DEPTH, LayerLoader, PrefetchStream
from blend_engine.kv_store.staging import HostBuffers, StagedLayer, StagingRing, StagingSlot
from blend_engine.transfer import LayerPacker
from tests.helpers import make_kv


class FakeStream:
    def __init__(self, device=None, name: str = "copies") -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"

    def wait_stream(self, other: FakeStream) -> None:
        LOG.append(("wait_stream", self, other))

    def wait_event(self, event: FakeEvent) -> None:
        LOG.append(("wait_event", self, event))

    def synchronize(self) -> None:
        LOG.append(("stream_sync", self))


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.stream: FakeStream | None = None
        self.done = False

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or CURRENT[-1]
        LOG.append(("record", self, self.stream))

    def synchronize(self) -> None:
        self.done = True
        LOG.append(("event_sync", self))

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: FakeEvent) -> float:
        return 1.0


COMPUTE = FakeStream(name="compute")
LOG: list[tuple] = []
CURRENT: list[FakeStream] = [COMPUTE]


@contextlib.contextmanager
def _on(stream: FakeStream):
    CURRENT.append(stream)
    try:
        yield
    finally:
        CURRENT.pop()


class CopyLog(TorchDispatchMode):
    """Logs every tensor copy (and index_select) with the stream it is queued on; counts all ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        if func is torch.ops.aten.copy_.default:
            LOG.append(("copy", CURRENT[-1]))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_cuda(monkeypatch):
    LOG.clear()
    CURRENT[:] = [COMPUTE]
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", _on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: CURRENT[-1])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: LOG.append(("record_stream", s)), raising=False)
    return LOG


def _index(kind: str, *match) -> int:
    return next(i for i, e in enumerate(LOG) if e[0] == kind and all(m is None or e[1 + j] is m for j, m in enumerate(match)))


# ---------------------------------------------------------------------------------- the device tier's upload
def test_device_tier_upload_waits_for_the_compute_stream_and_signals_it_from_the_copy_stream(fake_cuda):
    """The chunk's device tensor comes from the compute stream's pool; the copy stream must wait for
    that stream before writing it, and the compute stream must wait for an event recorded on the copy
    stream after the copies (the race the review found: neither ordering was there)."""
    store = DeviceStore(1 << 20, "cpu")
    store._cuda, store._copies = True, FakeStream(name="copies")
    kv = make_kv(0)
    with CopyLog():
        assert store.put("a", kv)
    copies = [i for i, e in enumerate(LOG) if e[0] == "copy" and e[1] is store._copies]
    assert copies, LOG
    assert all(e[1] is store._copies for e in LOG if e[0] == "copy")  # every byte moves on the copy stream
    assert _index("wait_stream", store._copies, COMPUTE) < copies[0]  # ordered after the compute stream
    record = _index("record", None, store._copies)
    event = LOG[record][1]
    assert record > copies[-1]  # the event follows the copies on the copy stream...
    assert _index("wait_event", COMPUTE, event) > record  # ...and the compute stream waits for it
    assert event.done  # the host buffers were read before put returned
    expected = decode_chunk(*encode_chunk("fp16", kv))
    assert torch.equal(store.get("a").k, expected.k) and torch.equal(store.get("a").v, expected.v)


# ---------------------------------------------------------------------------------- pinned buffers' lifetime
class _Pinned(np.ndarray):
    """A tier's pinned blob stand-in (an ndarray subclass: weak-referenceable, a buffer)."""


def test_a_pinned_blob_outlives_its_collected_slot_until_the_copy_fence_passes(fake_cuda, monkeypatch):
    """A tier's pinned blob is copied from a `frombuffer` view, which the allocator does not track:
    the slot holds it until its copy's fence. A request whose stream ends drops its slots while the
    last copy may be in flight; the blob must stay alive until that fence has passed (it was dropped
    with the slot)."""
    monkeypatch.setattr(staging_mod, "is_pinned", lambda blob: isinstance(blob, _Pinned))
    buffers = HostBuffers()
    slot = StagingSlot([4096], pinned=False, buffers=buffers)
    blob = np.arange(4096, dtype=np.uint8).view(_Pinned)
    alive = weakref.ref(blob)
    from blend_engine.kv_store.codec import ChunkMeta

    meta = ChunkMeta("fp16", 1, 1, 1, 2048, (0,))
    at, pinned, runs = StagedLayer(0, (meta,), (blob,), slot).gather()
    assert len(pinned) == 1 and not runs  # copied from where it lies, not through the slot
    fence = FakeEvent()
    slot.fence = fence  # the copy out of the slot (and of the blob) is in flight
    del blob, pinned, slot
    gc.collect()
    assert alive() is not None, "the blob was freed while its copy was in flight"
    again = buffers.take(4096 + 4096, pinned=False)  # the lease is reused: its fence is waited for first
    assert fence.done and alive() is None and not again.held


# ---------------------------------------------------------------------------------- read-ahead on CUDA
def test_the_default_loader_reads_two_layers_ahead_on_cuda_and_none_on_the_cpu(monkeypatch):
    store = MemoryStore(1 << 20)
    assert LayerLoader(store).prefetch_depth == 0  # no CUDA here: nothing to overlap
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    loader = LayerLoader(store)
    assert loader.prefetch_depth == CUDA_PREFETCH_DEPTH >= 2
    store.put("a", make_kv(0))
    s = loader.stream(["a"], 4, lambda k: pytest.fail(k))
    try:
        assert isinstance(s, PrefetchStream) and len(list(s)) == 4
    finally:
        s.close()
    assert LayerLoader(store, 0).prefetch_depth == 0  # an explicit depth is kept


# ---------------------------------------------------------------------------------- layers never placed
class CountingStore(MemoryStore):
    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.layers: list[int] = []

    def get_blob(self, key, layer):
        self.layers.append(layer)
        return super().get_blob(key, layer)

    def get_layer(self, key, layer):
        self.layers.append(layer)
        return super().get_layer(key, layer)


@pytest.mark.parametrize("depth", [0, 2])
def test_a_blend_never_loads_the_layers_it_recomputes_whole(tiny_runner, depth):
    """Below the check layer a blend recomputes every token: those layers of the cached chunks were
    read (and uploaded) for nothing. full_reuse places every layer, so it reads them all."""
    from blend_engine.engine import BlendEngine, EngineConfig
    from blend_engine.types import BlendPlan, Mode

    store = CountingStore(1 << 26, kv_format="fp32")
    engine = BlendEngine(tiny_runner, store, EngineConfig(kv_format="fp32"), loader=LayerLoader(store, depth))
    plan = BlendPlan(("Paris is the capital of France.", "The Danube flows into the Black Sea."), "Which river?")
    for seg in engine.layout(plan).segments:
        if seg.kind != "question":
            engine.cache_ids(seg.token_ids)
    check = engine.config.policy.check_layer
    n_layers = tiny_runner.shape.n_layers
    store.layers.clear()
    engine.prefill(BlendPlan(plan.passages, plan.question, mode=Mode.BLEND, recompute_ratio=0.5))
    assert store.layers and set(store.layers) == set(range(check, n_layers))
    store.layers.clear()
    engine.prefill(BlendPlan(plan.passages, plan.question, mode=Mode.FULL_REUSE))
    assert set(store.layers) == set(range(n_layers))


def test_a_skipped_layer_is_yielded_as_none_and_reads_nothing():
    store = CountingStore(1 << 20)
    store.put("a", make_kv(0))
    s = LayerLoader(store, 1).stream(["a"], 4, lambda k: pytest.fail(k), skip=range(2))
    try:
        items = list(s)
    finally:
        s.close()
    assert items[:2] == [None, None] and all(x is not None for x in items[2:])
    assert sorted(set(store.layers)) == [2, 3] and len(s.trace.read_s) == 4


# ---------------------------------------------------------------------------------- one gather per layer
class _Keep:
    """Hands each staged layer over as read (the packer runs in the test, under the op counter)."""

    def __init__(self, staging: StagingRing) -> None:
        self.staging = staging

    def __call__(self, staged):
        return staged


def _pack_staged(n_chunks: int, fmt: str = "fp16", device_chunk: bool = False):
    """Stream `n_chunks` memory-tier chunks (one from a device tier when asked) into a fake-CUDA packer;
    per layer: the ops it dispatched and the packed k, v against the host decode."""
    memory = MemoryStore(1 << 26, kv_format=fmt, pinned=False)
    device = DeviceStore(1 << 26, "cpu", kv_format=fmt)
    kvs = {f"c{i}": make_kv(i, T=5 + i % 7) for i in range(n_chunks)}
    for i, (k, kv) in enumerate(kvs.items()):
        (device if device_chunk and i == 1 else memory).put(k, kv)
    from blend_engine.kv_store.tiered import TieredStore

    store = TieredStore([device, memory]) if device_chunk else memory
    packer = LayerPacker("cpu", torch.float16, slots=3)
    packer._cuda, packer._stream = True, FakeStream(name="copies")
    packer.staging = StagingRing(3, pinned=False, gather=True)
    keys = list(kvs)
    expected = {k: decode_chunk(*encode_chunk(fmt, kv)) for k, kv in kvs.items()}
    s = LayerLoader(store, 0).stream(keys, 4, lambda k: pytest.fail(k), pack=_Keep(packer.staging))
    ops_per_layer = []
    try:
        for layer, staged in enumerate(s):
            with CopyLog() as log:
                packed = packer(staged)
            ops_per_layer.append(len(log.ops))
            want_k = torch.cat([expected[k].k[layer] for k in keys], dim=1)  # [H, Tc, D]
            want_v = torch.cat([expected[k].v[layer] for k in keys], dim=1)
            assert torch.equal(packed.k, want_k) and torch.equal(packed.v, want_v)
    finally:
        s.close()
    return ops_per_layer


def test_the_packer_takes_k_and_v_out_of_the_layer_block_by_one_gather(fake_cuda):
    """The device ops of one staged layer do not grow with the chunk count (the review counted ~450
    small dispatches per layer at 16K tokens: per-chunk views and a concatenation)."""
    few, many = _pack_staged(3), _pack_staged(24)
    assert max(many[1:]) == max(few[1:]), (few, many)  # after the first layer (which builds the index)
    assert max(many[1:]) <= 16  # allocation, the slot copy, views, the one index_select


def test_the_gather_takes_a_device_tier_chunk_in_place_and_every_float_format(fake_cuda):
    _pack_staged(4, device_chunk=True)  # values checked inside
    _pack_staged(4, fmt="bf16")
    _pack_staged(4, fmt="fp32")


# ---------------------------------------------------------------------------------- the carried weights
def test_load_packed_rebuilds_the_model_from_the_carry_with_tied_weights(tmp_path, real_runner):
    """`gpu_pack.load_packed` (what the GPU check runs first) on a tiny tied-embedding Llama: the
    config, the tokenizer, every matrix de-quantized exactly as `unpack3` gives it, norms in fp16
    and the tied head sharing the embeddings."""
    from benchmarks.gpu.gpu_pack import load_packed, pack3, pack_model, unpack3
    from blend_engine.model.runner import ModelRunner
    from tests.helpers import tiny_model

    model = tiny_model(tie_word_embeddings=True)
    runner = ModelRunner(model, real_runner.tokenizer, "tiny-tied")
    pack_model(tmp_path, runner)
    loaded, tok = load_packed(tmp_path, "cpu", torch.bfloat16)
    assert loaded.config.num_hidden_layers == model.config.num_hidden_layers and loaded.dtype == torch.bfloat16
    assert tok("Paris")["input_ids"] == real_runner.tokenizer("Paris")["input_ids"]
    state = loaded.state_dict()
    for name, w in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        want = (unpack3(**pack3(w), shape=w.shape, dtype=torch.bfloat16) if w.dim() >= 2
                else w.half().to(torch.bfloat16))
        assert torch.equal(state[name], want), name
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(loaded(ids).logits).all()
