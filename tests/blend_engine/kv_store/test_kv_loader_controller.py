"""Prefetching layer loader (overlap, repair, errors, close) and the bandwidth controller."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from benchmarks.common.policies import plain as plain_policy  # the old field defaults: one kv check
from blend_engine.kv_store import ChunkKV, MemoryStore
from blend_engine.kv_store.loader import LayerLoader, LayerStream, PrefetchStream
from blend_engine.scheduler.budget import PrefillWork
from blend_engine.scheduler.controller import BandwidthController
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


def report(load_ms: float, sizes: tuple[int, ...], times_ms: tuple[float, ...]) -> BlendReport:
    n = len(sizes)
    return BlendReport(
        mode="blend", recompute_ratio=0.15, ratio_source="controller", context_tokens=max(sizes),
        recomputed_tokens=sizes[-1], recomputed_positions=(), selected_per_layer=sizes,
        cache_hits=1, cache_misses=0, prefix_tokens_reused=0, repaired_chunks=0, assemble_ms=0.0, recompute_ms=0.0,
        load_ms=load_ms, load_wait_ms=0.0, prefill_ms=0.0, layer_load_ms=(load_ms / n,) * n, layer_compute_ms=times_ms,
    )


# injected timings: a layer costs 1 ms + 10 us per token; the last layer (one position) is not fitted
SIZES = (1000, 1000, 150, 150, 150)
TIMES = tuple(1.0 + 0.01 * n for n in SIZES[:-1]) + (0.3,)
WORK = PrefillWork(n_tokens=1000, n_cached=900, n_forced=100, n_layers=4, bytes_per_layer=3_000_000,
                   policy=plain_policy())  # one check, no narrowing: every selected layer keeps ratio x 900


def test_controller_priors_give_the_floor_for_cpu_scale_compute():
    c = BandwidthController()
    work = PrefillWork(n_tokens=4000, n_cached=3600, n_forced=400, n_layers=30, bytes_per_layer=3_000_000)
    choice = c.choose(work, MemoryStore(1 << 20))
    assert choice.ratio == pytest.approx(0.15) and not choice.full_prefill


def test_controller_fits_fixed_and_per_token_layer_costs():
    c = BandwidthController()
    c.observe(report(40.0, SIZES, TIMES), 1_000_000)  # 5 layers x 1 MB in 40 ms
    state = c.state()
    assert state.layer_fixed_s == pytest.approx(1e-3) and state.token_layer_s == pytest.approx(1e-5)
    assert state.bandwidth == pytest.approx(5e6 / 0.04)


def test_layer_times_shared_with_other_rows_teach_bandwidth_but_not_compute():
    c = BandwidthController()
    before = c.state()
    c.observe(report(40.0, SIZES, tuple(3 * t for t in TIMES)), 1_000_000, compute=False)
    state = c.state()
    assert (state.layer_fixed_s, state.token_layer_s) == (before.layer_fixed_s, before.token_layer_s)
    assert state.bandwidth == pytest.approx(5e6 / 0.04)


def test_controller_picks_the_smallest_ratio_whose_recompute_hides_the_next_load():
    c = BandwidthController(floor=0.0, cap=1.0)
    cost = (1e-3, 1e-5)
    # load 3 ms per layer: a selected layer must compute >= 200 tokens = 100 forced + ceil(r x 900)
    choice = c.plan(WORK, bandwidth=1e9, cost=cost)
    assert choice.ratio == pytest.approx(0.12) and not choice.full_prefill
    assert all(1e-3 + 1e-5 * n >= 3e-3 for n in WORK.tokens_per_layer(choice.ratio))
    assert not all(1e-3 + 1e-5 * n >= 3e-3 for n in WORK.tokens_per_layer(0.11))
    # the floor wins when compute already hides the load; the cap bounds it when nothing does
    assert BandwidthController(floor=0.3, cap=1.0).plan(WORK, 1e9, cost).ratio == pytest.approx(0.3)
    assert BandwidthController(floor=0.0, cap=0.05).plan(WORK, 1e9, cost).ratio == pytest.approx(0.05)
    # the schedule: with 2x kept at the check layer's successor and 1x from layer 3, layer 3 decides
    staged = PrefillWork(**{**WORK.__dict__, "policy": plain_policy(check_multiplier=2.0, schedule=((3, 1.0),))})
    assert staged.tokens_per_layer(0.12) == [1000, 1000, 100 + 216, 100 + 108]


def test_controller_serves_full_prefill_when_loading_is_slower():
    c = BandwidthController(floor=0.15, cap=0.5)
    cost = (1e-3, 1e-5)  # full prefill: 4 x (1 ms + 10 ms) = 44 ms
    slow = c.plan(WORK, bandwidth=3e6 / 0.05, cost=cost)  # 50 ms per layer: loading alone is 200 ms
    assert slow.full_prefill and slow.full_prefill_ms == pytest.approx(44.0)
    assert slow.predicted_ms > slow.full_prefill_ms
    fast = c.plan(WORK, bandwidth=3e6 / 0.002, cost=cost)  # 2 ms per layer
    assert not fast.full_prefill and fast.predicted_ms < fast.full_prefill_ms


def test_controller_probes_blend_again_after_a_run_of_fallbacks():
    """Loading is priced slower than recomputing: full prefill, but every third choice after two
    fallbacks in a row is served by blend, so the load is measured again."""
    c = BandwidthController(floor=0.15, cap=0.5, prior_bandwidth=3e6 / 0.05, prior_token_layer_s=1e-5,
                            prior_layer_fixed_s=1e-3, probe_every=2)
    store = MemoryStore(1 << 20)
    served = [c.choose(WORK, store).full_prefill for _ in range(6)]
    assert served == [True, True, False, True, True, False]
    assert c.state().full_prefill_choices == 4
    never = BandwidthController(floor=0.15, cap=0.5, prior_bandwidth=3e6 / 0.05, prior_token_layer_s=1e-5,
                                prior_layer_fixed_s=1e-3, probe_every=0)
    assert all(never.choose(WORK, store).full_prefill for _ in range(4))


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
    work = PrefillWork(n_tokens=500, n_cached=400, n_forced=100, n_layers=L, bytes_per_layer=2 * 2 * 400 * 4 * 2)
    choice = c.choose(work, store)
    assert c.state().tier_bandwidth["disk"] < 1e6  # ~12.8 kB per 50 ms
    assert choice.full_prefill  # 50 ms a layer against ~15 ms of prior compute: recomputing is faster


def test_controller_is_thread_safe():
    c = BandwidthController()
    store = MemoryStore(1 << 20)
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(200):
                c.observe(report(40.0, SIZES, TIMES), 1_000_000)
                assert 0.15 <= c.choose(WORK, store).ratio <= 0.5
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and c.state().observations == 800
