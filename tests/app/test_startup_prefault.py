"""The KV pool's pages are written once at start-up when BLENDSERVE_ENGINE_KV_POOL_PREFAULT is on, so that no
request pays the kernel for a page's first write (`KVPool.prefault`, `app.startup.prefault_pool`)."""

from __future__ import annotations

import resource

from fastapi.testclient import TestClient

from app.main import create_app
from blend_engine.executor.kv_pool import KVPool
from tests.helpers import FIXED_RATIO, make_settings, svc, wait_ready

PAGE = 4096


def pool_of(runner, mib: int, block_tokens: int = 16) -> KVPool:
    """A pool of about `mib` MiB for `runner` (each layer's K and V well past malloc's mmap threshold)."""
    s = runner.shape
    per_block = 2 * s.n_layers * s.n_kv_heads * s.head_dim * block_tokens * runner.dtype.itemsize
    return KVPool(runner, (mib << 20) // per_block, block_tokens)


def faults_writing(pool: KVPool) -> tuple[int, int]:
    """(minor page faults this thread took while writing every slot of the pool, the pool's pages)."""
    k, v = pool.kv
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for t in k + v:
        t.fill_(1.0)  # [H, slots, D]
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    return faults, sum(t.numel() * t.element_size() for t in k + v) // PAGE


def test_a_prefaulted_pool_takes_no_page_faults_when_first_written(tiny_runner):
    cold = pool_of(tiny_runner, 256)
    faults, pages = faults_writing(cold)
    assert faults > pages // 2  # without it, the first write of each page faults (the control)

    warm = pool_of(tiny_runner, 256)
    written = warm.prefault()
    assert written == pages * PAGE
    assert all(bool((t == 0).all()) for t in warm.kv[0] + warm.kv[1])
    faults, pages = faults_writing(warm)
    assert faults < pages // 100


def test_prefault_allocates_the_pool_once_for_its_life(tiny_runner):
    pool = pool_of(tiny_runner, 8)
    pool.prefault()
    kv = pool.kv
    pool.prefault()
    assert pool.kv is kv and pool.kv[0][0].data_ptr() == kv[0][0].data_ptr()  # caches compare it by identity


def engine_settings(tmp_path, prefault: bool):
    return make_settings(tmp_path / "data", engine={"recompute_ratio": FIXED_RATIO, "batch_kv_mb": 64,
                                                     "kv_pool_prefault": prefault})


def test_the_service_writes_its_pool_before_it_is_ready(tmp_path, tiny_stack_factory, caplog):
    caplog.set_level("INFO", logger="app.startup")
    with TestClient(create_app(engine_settings(tmp_path, True), tiny_stack_factory)) as c:
        wait_ready(c)
        pool = svc(c).stack.engine.loop.pool
        assert pool._kv is not None
        assert all(bool((t == 0).all()) for t in pool.kv[0] + pool.kv[1])
    lines = caplog.text.splitlines()
    written = next(i for i, ln in enumerate(lines) if "KV pool:" in ln and "written once" in ln)
    ready = next(i for i, ln in enumerate(lines) if "ready in" in ln)
    assert written < ready
    assert "64 MiB" in lines[written] or "63 MiB" in lines[written]


def test_with_prefault_off_the_pool_waits_for_its_first_use(tmp_path, tiny_stack_factory, caplog):
    caplog.set_level("INFO", logger="app.startup")
    with TestClient(create_app(engine_settings(tmp_path, False), tiny_stack_factory)) as c:
        wait_ready(c)
        assert svc(c).stack.engine.loop.pool._kv is None
    assert "written once" not in caplog.text


def test_prefault_is_off_by_default_and_read_from_its_env_name(monkeypatch, tmp_path):
    from blendserve_config.groups import EngineSettings

    assert EngineSettings().kv_pool_prefault is False
    monkeypatch.setenv("BLENDSERVE_ENGINE_KV_POOL_PREFAULT", "true")
    assert make_settings(tmp_path).engine.kv_pool_prefault is True
    monkeypatch.setenv("BLENDSERVE_ENGINE_KV_POOL_PREFAULT", "false")
    assert make_settings(tmp_path).engine.kv_pool_prefault is False
