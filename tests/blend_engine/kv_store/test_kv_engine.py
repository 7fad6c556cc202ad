"""The store stack under a real (tiny, random) engine: disk equals memory, corruption is repaired."""

from __future__ import annotations

import functools

import pytest
import torch

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.keys import store_fingerprint
from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.factory import build_loader, build_store
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.controller import BandwidthController
from blend_engine.scheduler.plans import RatioSource
from blend_engine.types import BlendPlan
from tests import helpers

PASSAGES = (
    "Paris is the capital of France. It lies on the Seine and has about two million inhabitants.",
    "The Danube flows through ten countries, more than any other river in the world, into the Black Sea.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, a dormant volcano with three cones.",
)
QUESTION = "Which river flows through ten countries?"


@functools.lru_cache(maxsize=1)
def tiny_runner() -> ModelRunner:
    return helpers.tiny_runner()


def engine_on(store, kv_format: str = "fp16", depth: int = 2, controller=None) -> BlendEngine:
    return BlendEngine(tiny_runner(), store, EngineConfig(kv_format=kv_format), loader=build_loader(store, depth),
                       controller=controller)


def fingerprint(kv_format: str = "fp16") -> str:
    return store_fingerprint(tiny_runner().fingerprint, kv_format)


def plan(ratio: float | None = 0.3) -> BlendPlan:
    return BlendPlan(passages=PASSAGES, question=QUESTION, recompute_ratio=ratio)


@pytest.mark.parametrize("kv_format", ["fp16", "int8"])
def test_blend_from_disk_equals_blend_from_memory(tmp_path, kv_format):
    mem_engine = engine_on(MemoryStore(1 << 26, kv_format=kv_format), kv_format)
    for p in PASSAGES:
        mem_engine.ensure_cached(p)
    from_memory = mem_engine.prefill(plan())

    fp = fingerprint(kv_format)
    writer = engine_on(build_store(kv_format=kv_format, disk_dir=tmp_path, fingerprint=fp), kv_format)
    for p in PASSAGES:
        writer.ensure_cached(p)
    writer.store.close()
    disk_only = build_store(kv_format=kv_format, disk_dir=tmp_path, fingerprint=fp)  # fresh process view: RAM empty
    assert not disk_only.tiers[0].contains(mem_engine.key_of(mem_engine.passage_tokens(PASSAGES[0])))
    from_disk = engine_on(disk_only, kv_format).prefill(plan())

    assert from_disk.report.cache_hits >= 3 and from_disk.report.repaired_chunks == 0
    assert torch.equal(from_disk.logits, from_memory.logits)
    assert from_disk.report.recomputed_positions == from_memory.report.recomputed_positions
    assert len(from_disk.report.layer_load_ms) == tiny_runner().shape.n_layers
    assert disk_only.stats().extra["promotions"] >= 3  # the chunks moved up into memory


def test_corrupted_byte_on_disk_is_repaired_by_recompute(tmp_path):
    fp = fingerprint()
    reference = engine_on(MemoryStore(1 << 26))
    for p in PASSAGES:
        reference.ensure_cached(p)
    expected = reference.prefill(plan()).logits

    writer = engine_on(build_store(disk_dir=tmp_path, fingerprint=fp))
    for p in PASSAGES:
        writer.ensure_cached(p)
    key = writer.key_of(writer.passage_tokens(PASSAGES[1]))
    path = writer.store.tier("disk").path(key)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # one byte of the last layer
    path.write_bytes(data)

    store = build_store(disk_dir=tmp_path, fingerprint=fp)
    state = engine_on(store).prefill(plan())
    assert state.report.repaired_chunks == 1
    # the corrupt chunk counts as a miss (so does the system prefix: prefill alone does not store it)
    assert (state.report.cache_hits, state.report.cache_misses) == (len(PASSAGES) - 1, 2)
    assert store.stats().corrupt == 1
    assert torch.equal(state.logits, expected)  # repaired values are used in stored precision
    assert store.tier("disk").contains(key) and store.tier("memory").contains(key)  # re-stored
    again = engine_on(build_store(disk_dir=tmp_path, fingerprint=fp)).prefill(plan())
    assert again.report.repaired_chunks == 0 and torch.equal(again.logits, expected)
    assert (again.report.cache_hits, again.report.cache_misses) == (len(PASSAGES), 1)


def test_wrong_fingerprint_on_disk_is_a_miss_for_the_engine(tmp_path):
    writer = engine_on(build_store(disk_dir=tmp_path, fingerprint="another-model:fp16:v1"))
    key = writer.key_of(writer.passage_tokens(PASSAGES[0]))
    writer.store.put(key, writer.precompute(writer.passage_tokens(PASSAGES[0])))
    reader = engine_on(build_store(disk_dir=tmp_path, fingerprint=fingerprint()))
    assert reader.ensure_cached(PASSAGES[0])[2] is False  # miss: recomputed and stored under our fingerprint
    assert reader.store.tier("disk").contains(key)


def test_controller_drives_the_ratio_and_learns(tmp_path):
    store = build_store(disk_dir=tmp_path, fingerprint=fingerprint())
    ctl = BandwidthController(floor=0.15, cap=0.5)
    eng = engine_on(store, controller=ctl)
    for p in PASSAGES:
        eng.ensure_cached(p)
    result = eng.run(plan(ratio=None))
    assert result.report.ratio_source == "controller"
    assert 0.15 <= result.report.recompute_ratio <= 0.5
    assert ctl.state().observations == 1
    assert result.report.cache_hits >= len(PASSAGES)  # the passages' KV came from the store...
    assert result.report.load_ms > 0 and result.report.load_hidden_ms <= result.report.load_ms  # ...and took time


class _Recording(BandwidthController):
    """The real controller, recording the work it was asked about."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.works = []

    def choose(self, work, store):
        self.works.append(work)
        return super().choose(work, store)


def test_controller_counts_misses_as_uncached_work():
    store = MemoryStore(1 << 26)
    ctl = _Recording()
    eng = engine_on(store, controller=ctl)
    for p in PASSAGES[1:]:  # the first passage misses
        eng.ensure_cached(p)
    eng.ensure_cached(PASSAGES[0])
    store.delete(eng.key_of(eng.passage_tokens(PASSAGES[0])))
    state = eng.prefill(plan(ratio=None))
    work = ctl.works[-1]
    segs = state.layout.segments
    loaded = sum(len(s.token_ids) for s in segs[2:-1])
    assert state.report.cache_misses == 2  # the system prefix (never stored here) and the first passage
    assert work.n_cached == loaded and work.n_tokens == state.layout.n_tokens
    assert work.n_forced == state.layout.n_tokens - loaded  # the misses and the question
    assert work.bytes_per_layer == 2 * 2 * loaded * 16 * 2  # fp16 k and v, 2 kv heads, head dim 16


def test_controller_serves_full_prefill_when_loading_is_too_slow():
    store = MemoryStore(1 << 26)
    ctl = BandwidthController(prior_bandwidth=1e3)  # 1 kB/s: loading can never beat recomputing
    eng = engine_on(store, controller=ctl)
    for p in PASSAGES:
        eng.ensure_cached(p)
    served = eng.prefill(plan(ratio=None))
    full = eng.prefill(BlendPlan(passages=PASSAGES, question=QUESTION, mode="full_prefill"))
    assert served.report.mode == "full_prefill" and served.report.ratio_source == RatioSource.FULL_PREFILL.value
    assert served.report.recompute_ratio == 1.0 and served.report.layer_load_ms == ()
    assert torch.equal(served.logits, full.logits)
    assert ctl.state().full_prefill_choices == 1 and ctl.state().observations == 1


def test_batched_precompute_equals_one_at_a_time():
    eng = engine_on(MemoryStore(1 << 26))
    lists = [eng.passage_tokens(p) for p in PASSAGES] + [eng.passage_tokens("Short one.")]
    for ids, many in zip(lists, eng.precompute_many(lists, batch_size=3)):  # right-padded batches
        one = eng.precompute(ids)
        assert many.k.shape == one.k.shape
        assert torch.allclose(many.k, one.k, atol=1e-5) and torch.allclose(many.v, one.v, atol=1e-5)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_int8_dequantized_after_the_move_equals_the_host_decode(tmp_path, monkeypatch, tier):
    """The device path (int8 packed as stored, dequantized where the model runs), forced on the CPU,
    gives the logits and selection of the host decode; from disk with a corrupted chunk repaired."""
    import blend_engine.executor.prefill as prefill_mod
    from blend_engine.transfer import LayerPacker

    def run(moves_int8: bool):
        class Packer(LayerPacker):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                self.moves_int8 = moves_int8

        monkeypatch.setattr(prefill_mod, "LayerPacker", Packer)
        fp = fingerprint("int8")
        store = (MemoryStore(1 << 26, kv_format="int8", fingerprint=fp) if tier == "memory"
                 else build_store(kv_format="int8", disk_dir=tmp_path / str(moves_int8), fingerprint=fp))
        engine = engine_on(store, "int8")
        for p in PASSAGES:
            engine.ensure_cached(p)
        if tier == "disk":
            store.tiers[0].delete(engine.key_of(engine.passage_tokens(PASSAGES[1])))  # only on disk now
            path = store.tier("disk").path(engine.key_of(engine.passage_tokens(PASSAGES[1])))
            data = bytearray(path.read_bytes())
            data[-7] ^= 0xFF  # a flipped byte in the last layer: repaired mid-stream
            path.write_bytes(bytes(data))
        return engine.prefill(plan(0.3))

    host, moved = run(False), run(True)
    assert torch.equal(moved.logits, host.logits)
    assert moved.report.recomputed_positions == host.report.recomputed_positions
    assert moved.report.repaired_chunks == host.report.repaired_chunks == (1 if tier == "disk" else 0)
