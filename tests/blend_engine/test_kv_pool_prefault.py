"""The KV pool's memory faulted in ahead of use (`KVPool.prefault_steps`, `EngineLoop.prefault_pool`):
pages become resident, nothing in them changes, and the job runs as the engine loop's background work."""

from __future__ import annotations

import mmap

import pytest
import torch

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.kv_pool import KVPool, populate
from blend_engine.kv_store import MemoryStore
from blend_engine.scheduler.batch import BatchLimits
from blend_engine.steps import drain


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_populate_makes_fresh_pages_resident():
    t = torch.empty(16 << 20)  # 64 MiB, reserved only
    before = resident_bytes()
    if not populate(t.data_ptr(), t.numel() * 4):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_bytes() - before >= 60 << 20


def test_populate_changes_nothing_in_memory_already_written():
    t = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    want = t.clone()
    assert populate(t.data_ptr() + 100, t.numel() * 4 - 200)  # unaligned ends: their whole pages
    assert torch.equal(t, want)


def test_prefault_covers_every_layer_and_head_and_keeps_the_kv_written(tiny_runner):
    pool = KVPool(tiny_runner, n_blocks=64, block_tokens=16)
    k, v = pool.kv
    g = torch.Generator().manual_seed(1)
    for t in (*k, *v):
        t[:, :100] = torch.randn(t[:, :100].shape, generator=g)  # a run already written
    want = [t.clone() for t in (*k, *v)]
    steps = pool.prefault_steps(unit_bytes=64 << 10)
    units = 0
    while True:
        try:
            next(steps)
            units += 1
        except StopIteration as end:
            done = end.value
            break
    assert done == sum(t.numel() * t.element_size() for t in (*k, *v))
    assert units > 1  # cut into units, each a window of slots across every tensor and head
    assert all(torch.equal(a, b) for a, b in zip((*k, *v), want))


def test_the_engine_loop_prefaults_as_background_work(tiny_runner):
    engine = BlendEngine(tiny_runner, MemoryStore(64 << 20), EngineConfig(batch=BatchLimits(kv_budget_bytes=8 << 20)))
    try:
        engine.loop.start()
        done = engine.loop.prefault_pool()
        k, v = engine.loop.pool.kv
        assert done == sum(t.numel() * t.element_size() for t in (*k, *v)) > 0
        assert drain(engine.loop.pool.prefault_steps()) == done  # again: already resident, the same bytes
    finally:
        engine.close()
