"""One compute thread per process (`cpu_threads`): helper threads on one core, the engine loop on all."""

from __future__ import annotations

import threading

import pytest
import torch

from blend_engine.engine import BlendEngine
from blend_engine.kv_store import MemoryStore
from blend_engine.model import cpu_threads

pytestmark = pytest.mark.skipif(cpu_threads._omp() is None, reason="torch without libgomp: counts stay torch's")


CORES = 2  # the process's count before the service's set-up (the test session runs on one)


@pytest.fixture
def single_core_default(monkeypatch):
    """The service's set-up (`app.__main__`) on a process of `CORES` threads, undone afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "_cores", None)
    torch.set_num_threads(CORES)
    assert cpu_threads.single_core_default() == CORES
    assert torch.get_num_threads() == 1
    yield CORES
    torch.set_num_threads(before)


def on_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_new_threads_default_to_one_core_and_a_compute_thread_takes_all(single_core_default):
    assert cpu_threads.cores() == single_core_default
    assert on_new_thread(torch.get_num_threads) == 1  # a helper: no OpenMP team of its own

    def compute() -> int:
        cpu_threads.use_cores()
        torch.ones(1 << 20).sum()  # a parallel op after: torch's per-thread set-up must not reset it
        return torch.get_num_threads()

    assert on_new_thread(compute) == single_core_default


def test_the_cpu_decode_kernel_keeps_a_compute_threads_cores(single_core_default):
    """The C++ decode kernel runs on the calling thread's team and leaves its count alone (built on
    at::parallel_for, its first call on a thread put the engine loop back on one core)."""
    from blend_engine.model import cpu_kernels

    assert cpu_kernels.ensure(), cpu_kernels.why_not()

    def compute() -> int:
        cpu_threads.use_cores()
        q, k = torch.randn(4, 2, 3, 16), torch.randn(2, 64, 16)  # [B, H, G, D], [H, slots, D]
        start, n = torch.tensor([0, 16, 32, 48]), torch.tensor([16, 16, 16, 16])
        cpu_kernels.paged_decode(q, k, k, start, n, n - 1, None, 0.25)
        return torch.get_num_threads()

    assert on_new_thread(compute) == single_core_default


def test_counts_are_per_thread_and_restored():
    def three_then_back() -> tuple[int, int, int]:
        before = cpu_threads.thread_cores()
        with cpu_threads.cores_here(3):
            inside = torch.get_num_threads()
            torch.ones(1 << 20).sum()
        return before, inside, torch.get_num_threads()

    main_before = torch.get_num_threads()
    before, inside, after = on_new_thread(three_then_back)
    assert (inside, after) == (3, before)
    assert torch.get_num_threads() == main_before  # not the other threads'
    assert on_new_thread(lambda: (cpu_threads.use_cores(3), cpu_threads.one_core(), torch.get_num_threads())[2]) == 1
    with pytest.raises(ValueError, match="cores must be >= 1"):
        cpu_threads.use_cores(0)


def test_torchs_libraries_are_found_when_it_is_reached_through_a_symbolic_link(tmp_path, monkeypatch):
    """/proc/self/maps lists resolved paths: a virtual environment reached through a link (a work
    tree's .venv, /opt/venv) must still find torch's libgomp, or the engine loop runs on one core."""
    import os

    real_dir = os.path.dirname(torch.__file__)
    (tmp_path / "torch").symlink_to(real_dir, target_is_directory=True)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    found = cpu_threads._loaded("libgomp")
    assert found is not None and found.startswith(os.path.realpath(real_dir))


@pytest.mark.skipif(cpu_threads._mkl_local() is None, reason="torch without MKL")
def test_mkl_gets_the_threads_count_too():
    """MKL's thread-local count (its GEMMs) follows: setting it again returns what use_cores set."""
    assert on_new_thread(lambda: (cpu_threads.use_cores(3), cpu_threads._mkl_local()(0))[1]) == 3


def test_the_engine_loop_computes_on_every_core_while_callers_are_on_one(tiny_runner, single_core_default):
    eng = BlendEngine(tiny_runner, MemoryStore(1 << 26))
    try:
        assert eng.loop.run_task(torch.get_num_threads) == 1  # not started: on the caller (one core here)
        eng.loop.start()
        assert eng.loop.run_task(torch.get_num_threads) == single_core_default  # on the loop thread
    finally:
        eng.close()
