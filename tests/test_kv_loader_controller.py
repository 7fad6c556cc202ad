"""Prefetching layer loader (overlap, repair, errors, close) and the bandwidth controller."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from blend_engine.kv_store import ChunkKV, MemoryStore
from blend_engine.kv_store.controller import BandwidthController
from blend_engine.kv_store.loader import LayerLoader, LayerStream, PrefetchStream
from blend_engine.types import BlendReport
from tests import helpers

L = 6
make_kv = functools.partial(helpers.make_kv, L=L, T=5, D=4)


class SlowStore(MemoryStore):
    """A memory store whose layer reads take `delay` seconds and can be made to fail."""

    def __init__(self, delay: float) -> None:
        super().__init__(1 << 24)
        self.delay = delay
        self.fail_at: tuple[str, int] | None = None

    def get_layer(self, key, layer):
        time.sleep(self.delay)
        if self.fail_at == (key, layer):
            return None
        return super().get_layer(key, layer)


def test_prefetch_overlaps_reads_with_compute():
    store = SlowStore(0.02)
    store.put("a", make_kv(1))
    stream = LayerLoader(store, prefetch_depth=2).stream(["a"], L, repair=lambda k: pytest.fail("no repair"))
    assert isinstance(stream, PrefetchStream)
    for layer_kv in stream:
        assert layer_kv[0][0].shape == (2, 5, 4)
        time.sleep(0.03)  # "compute" longer than a read: every read after the first is hidden
    stream.close()
    t = stream.trace
    assert len(t.read_s) == len(t.wait_s) == L
    assert sum(t.read_s) >= L * 0.02
    assert sum(t.wait_s[1:]) < 0.5 * sum(t.read_s[1:])


def test_synchronous_stream_hides_nothing():
    store = SlowStore(0.01)
    store.put("a", make_kv(1))
    stream = LayerLoader(store, prefetch_depth=0).stream(["a"], L, repair=lambda k: pytest.fail("no repair"))
    assert type(stream) is LayerStream
    list(stream)
    assert stream.trace.wait_s == stream.trace.read_s


def test_missing_layer_is_repaired_restored_and_counted():
    store = SlowStore(0.0)
    good, bad = make_kv(1), make_kv(2)
    store.put("a", good)
    store.put("b", bad)
    store.fail_at = ("b", 3)  # corrupt mid-stream
    calls: list[str] = []

    def repair(key):
        calls.append(key)
        return ChunkKV(bad.k.float(), bad.v.float())

    stream = LayerLoader(store, prefetch_depth=2).stream(["a", "b"], L, repair)
    layers = list(stream)
    stream.close()
    assert calls == ["b"] and stream.trace.repaired == ["b"]
    assert torch.equal(layers[5][1][0], bad.k[5]) and layers[5][1][0].dtype == torch.float16  # stored precision
    assert torch.equal(layers[2][0][1], good.v[2])
    assert store.stats().puts == 3


def test_reader_errors_surface_in_the_consumer():
    store = MemoryStore(1 << 20)

    def repair(key):
        raise RuntimeError(f"cannot rebuild {key}")

    stream = LayerLoader(store, prefetch_depth=2).stream(["gone"], L, repair)
    with pytest.raises(RuntimeError, match="cannot rebuild gone"):
        list(stream)
    stream.close()


def test_close_mid_stream_stops_the_reader():
    store = SlowStore(0.005)
    store.put("a", make_kv(1))
    before = threading.active_count()
    stream = LayerLoader(store, prefetch_depth=1).stream(["a"], L, repair=lambda k: pytest.fail("no repair"))
    next(iter(stream))
    stream.close()
    assert threading.active_count() == before
    assert len(stream.trace.read_s) < L


def report(load_ms: float, layer_compute_ms: float, n_layers: int = 4, tokens: int = 1000, selected: int = 150):
    return BlendReport(
        mode="blend", recompute_ratio=0.15, ratio_source="controller", context_tokens=tokens,
        recomputed_tokens=selected, recomputed_positions=(), selected_per_layer=(tokens, tokens) + (selected,) * (n_layers - 2),
        cache_hits=1, cache_misses=0, prefix_tokens_reused=0, repaired_chunks=0, assemble_ms=0.0, recompute_ms=0.0,
        load_ms=load_ms, load_wait_ms=0.0, prefill_ms=0.0, layer_load_ms=(load_ms / n_layers,) * n_layers,
        layer_compute_ms=(layer_compute_ms,) * n_layers,
    )


def test_controller_priors_give_the_floor_for_cpu_scale_compute():
    c = BandwidthController()
    store = MemoryStore(1 << 20)
    assert c.choose(4000, 30, 3_000_000, store) == pytest.approx(0.15)


def test_controller_balances_load_and_compute_within_bounds():
    c = BandwidthController(floor=0.15, cap=0.5)
    store = MemoryStore(1 << 20)
    bpl = 1_000_000
    # load: 4 layers x 1 MB in 40 ms -> 100 MB/s -> 10 ms per layer; compute 1.5 ms per 150 tokens -> 10 us/token
    c.observe(report(load_ms=40.0, layer_compute_ms=1.5), bpl)
    bw, per_token = c.estimate()
    assert bw == pytest.approx(1e8) and per_token == pytest.approx(1e-5)
    assert c.choose(1000, 4, bpl, store) == pytest.approx(0.5)  # 10 ms / (1000 x 10 us) = 1.0, capped
    assert c.choose(4000, 4, bpl, store) == pytest.approx(0.25)  # 10 ms / 40 ms
    assert c.choose(100_000, 4, bpl, store) == pytest.approx(0.15)  # floor
    with pytest.raises(ValueError):
        BandwidthController(floor=0.6, cap=0.5)


def test_controller_reads_tier_bandwidth_before_any_report(tmp_path):
    from blend_engine.kv_store.disk import DiskStore
    from blend_engine.kv_store.tiered import TieredStore

    class SlowDisk(DiskStore):
        def get_blob(self, key, layer):
            got = super().get_blob(key, layer)
            self._stats.read_seconds += 0.05  # pretend every layer read took 50 ms
            return got

    disk = SlowDisk(tmp_path, 1 << 24)
    store = TieredStore([MemoryStore(1 << 24), disk])
    disk.put("a", make_kv(1, T=400))
    c = BandwidthController(floor=0.0, cap=1.0)
    for layer in range(L):
        store.get_layer("a", layer)
    r = c.choose(400, L, 2 * 2 * 400 * 4 * 2, store)
    assert c.state().tier_bandwidth["disk"] < 1e6  # ~12.8 kB per 50 ms
    assert r > 0.5


def test_controller_is_thread_safe():
    c = BandwidthController()
    store = MemoryStore(1 << 20)
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(200):
                c.observe(report(40.0, 1.5), 1_000_000)
                assert 0.15 <= c.choose(4000, 4, 1_000_000, store) <= 0.5
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and c.state().observations == 800
