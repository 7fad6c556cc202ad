"""The controller prices the whole load path per tier (delivery into staging + upload), starting
from estimates measured once at start-up (`calibrate`, one seam): injected timings and counters
here, one real calibration on the tiny model, and a real stream's counters."""

from __future__ import annotations

import math

import pytest
import torch

from blend_engine.kv_store import MemoryStore
from blend_engine.kv_store.base import KVStore, StoreStats
from blend_engine.kv_store.device import DeviceStore
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.kv_store.tiered import TieredStore
from blend_engine.scheduler.budget import PrefillWork
from blend_engine.scheduler.controller import BandwidthController, PathCosts
from blend_engine.transfer import LayerPacker, calibrate
from tests.helpers import make_kv

GB = 1e9
COSTS = PathCosts(storage_read_s=1 / (2 * GB), stage_s=1 / (10 * GB), upload_s=1 / (4 * GB),
                  layer_fixed_s=2e-4, token_layer_s=1e-7)


class Counters(KVStore):
    """A store that is only its counters: per tier (name, kind, bytes_read, read_seconds), and the
    uploads the layer streams reported."""

    def __init__(self) -> None:
        self.counted: dict[str, list] = {}
        self.upload = [0, 0.0]

    def read(self, name: str, kind: str, nbytes: int, seconds: float) -> None:
        t = self.counted.setdefault(name, [kind, 0, 0.0])
        t[1] += nbytes
        t[2] += seconds

    def stats(self) -> StoreStats:
        tiers = [StoreStats(name=n, kind=k, bytes_read=b, read_seconds=s).as_dict() for n, (k, b, s) in self.counted.items()]
        return StoreStats(name="tiered", extra={"tiers": tiers, "upload_bytes": self.upload[0],
                                                "upload_seconds": self.upload[1]})

    contains = put = get_layer = get = delete = None  # never called


def test_start_up_estimates_are_measured_once_and_price_a_first_request():
    calls = []

    def measure() -> PathCosts:
        calls.append(1)
        return COSTS

    c = BandwidthController(calibrate=measure)
    bw, per_token = c.estimate()
    assert bw == pytest.approx(1 / (COSTS.storage_read_s + COSTS.upload_s))  # a disk read plus its upload
    assert per_token == COSTS.token_layer_s and c.state().layer_fixed_s == COSTS.layer_fixed_s
    for _ in range(3):
        c.choose(PrefillWork(n_tokens=1000, n_cached=900, n_forced=100, n_layers=4, bytes_per_layer=1 << 20), Counters())
    assert calls == [1]  # once, when the controller was built
    # without a calibration: the CPU constants
    assert BandwidthController().estimate() == (pytest.approx(1e9), pytest.approx(30e-6))


def test_path_costs_reject_negative_and_nan_timings():
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="stage_s"):
            PathCosts(storage_read_s=1e-9, stage_s=bad, upload_s=1e-9, layer_fixed_s=0.0, token_layer_s=1e-6)


def test_each_tier_is_priced_by_its_whole_path_so_memory_is_not_free():
    """Injected counters: the memory tier's delivery costs its staging copy, the disk tier its read,
    both plus the measured upload; the device tier costs nothing. Then the mix by bytes served."""
    store = Counters()
    c = BandwidthController(floor=0.0, cap=1.0, calibrate=lambda: COSTS)
    store.read("memory", "memory", 10_000_000, 0.001)  # 10 GB/s into staging
    store.read("disk", "storage", 10_000_000, 0.005)  # 2 GB/s
    store.read("device", "device", 10_000_000, 0.0)
    store.upload = [20_000_000, 0.004]  # 5 GB/s over PCIe (measured: replaces the calibrated 4 GB/s)
    c.choose(PrefillWork(n_tokens=10, n_cached=5, n_forced=5, n_layers=2, bytes_per_layer=1), store)
    bw = c.state().tier_bandwidth
    assert bw["memory"] == pytest.approx(1 / (1e-10 + 2e-10))  # 3.3 GB/s, not infinite
    assert bw["disk"] == pytest.approx(1 / (5e-10 + 2e-10))
    assert bw["device"] == math.inf
    third = 1 / 3
    mixed = 1 / (third * (3e-10) + third * (7e-10) + third * 0.0)
    assert c.state().bandwidth == pytest.approx(mixed)
    # a pinned memory tier delivers in place (no read time): its path is the upload alone
    store.read("memory", "memory", 10_000_000, 0.0)
    store.upload = [40_000_000, 0.008]
    c.choose(PrefillWork(n_tokens=10, n_cached=5, n_forced=5, n_layers=2, bytes_per_layer=1), store)
    assert 1 / c.state().tier_bandwidth["memory"] == pytest.approx(0.7 * 1e-10 + 0.3 * 0.0 + 2e-10)  # EWMA 0.3


def test_a_memory_hit_too_slow_to_hide_sends_a_request_to_full_prefill():
    """The same work: with the upload priced in, loading from the memory tier no longer hides
    behind compute and the controller serves full prefill; a device tier hit still blends."""
    slow = PathCosts(storage_read_s=1e-9, stage_s=0.0, upload_s=1 / (0.05 * GB), layer_fixed_s=1e-3,
                     token_layer_s=1e-6)
    work = PrefillWork(n_tokens=2000, n_cached=1800, n_forced=200, n_layers=8, bytes_per_layer=4_000_000)
    for kind, full in (("memory", True), ("device", False)):
        store = Counters()
        store.read(kind, kind, 4_000_000, 0.0)
        c = BandwidthController(floor=0.15, cap=0.5, calibrate=lambda: slow, probe_every=0)
        assert c.choose(work, store).full_prefill is full


def test_a_real_stream_reports_its_staging_copy_and_upload_to_the_controller(tmp_path):
    """Memory over disk, streamed into a CPU packer: the upload (the packing copy) reaches the
    store's counters; with a gathering consumer the memory tier's staging copy is its read time."""
    memory = MemoryStore(1 << 26, pinned=False)
    disk = DiskStore(tmp_path, 1 << 26)
    store = TieredStore([memory, disk])
    memory.put("m", make_kv(1, T=64))
    disk.put("d", make_kv(2, T=64))
    s = LayerLoader(store, 1).stream(["m", "d"], 4, lambda k: pytest.fail(k), pack=LayerPacker("cpu", torch.float32))
    list(s)
    s.close()
    extra = store.stats().extra
    assert extra["upload_bytes"] == 2 * 4 * 2 * 64 * 8 * 2 * 2 and extra["upload_seconds"] > 0
    assert memory.stats().read_seconds == 0  # handed over in place: no staging copy on the CPU
    gathering = LayerPacker("cpu", torch.float32)
    gathering.staging.gather = True  # as on CUDA with a pageable memory tier
    s = LayerLoader(store, 1).stream(["m"], 4, lambda k: pytest.fail(k), pack=gathering)
    list(s)
    s.close()
    assert memory.stats().read_seconds > 0  # the copies into staging are the memory tier's delivery time
    c = BandwidthController()
    c.choose(PrefillWork(n_tokens=10, n_cached=5, n_forced=5, n_layers=2, bytes_per_layer=1), store)
    assert c.state().tier_bandwidth["memory"] < math.inf and c.state().tier_bandwidth["disk"] < math.inf


def test_a_device_tier_moves_nothing_and_its_hits_are_priced_free(tmp_path):
    device = DeviceStore(1 << 26, "cpu")
    store = TieredStore([device, MemoryStore(1 << 26, pinned=False)])
    device.put("g", make_kv(1, T=64))
    packer = LayerPacker("cpu", torch.float32)
    s = LayerLoader(store, 0).stream(["g"], 4, lambda k: pytest.fail(k), pack=packer)
    list(s)
    s.close()
    assert store.stats().extra.get("upload_bytes", 0) == 0
    c = BandwidthController(calibrate=lambda: COSTS)
    c.choose(PrefillWork(n_tokens=10, n_cached=5, n_forced=5, n_layers=2, bytes_per_layer=1), store)
    assert c.state().tier_bandwidth["device"] == math.inf


def test_calibration_measures_the_real_path_on_the_tiny_model(tiny_runner, tmp_path):
    costs = calibrate(tiny_runner, "fp16", reps=1, workdir=tmp_path / "kv")
    assert list((tmp_path / "kv").iterdir()) == []  # the probe file was written there and removed
    assert 0 < costs.storage_read_s < 1e-6 and 0 < costs.upload_s < 1e-6  # faster than 1 MB/s, not free
    assert costs.stage_s == 0.0  # the CPU packer takes the memory tier's buffer in place
    assert costs.token_layer_s > 0 and costs.layer_fixed_s >= 0
    c = BandwidthController(calibrate=lambda: costs)
    assert c.estimate()[1] == costs.token_layer_s
