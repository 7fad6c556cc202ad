"""Which threads compute on several CPU cores: one compute thread per process.

torch on the CPU runs its parallel ops on OpenMP (GNU libgomp). Each thread that ever ran one owns
a team of worker threads for life, and libgomp keeps its idle workers spinning between parallel
regions only while the process's OpenMP threads number no more than its CPUs; past that every
region's workers go to sleep and must be woken. A decode step is ~400 small GEMMs and elementwise
ops, so it pays that wake-up ~400 times: on 2 cores its projections took 60 ms at 8 rows and
36 ms at 2 rows from a second thread once another thread had a team, against 41 and 18 ms
(benchmarks/results/cpu_threads/). A service has request threads, store readers, a job thread and
a start-up thread beside its engine loop; any of them running one parallel op puts the process past
the limit for good.

So the service's entry point calls `single_core_default()` before its threads start: from then on a
thread runs torch on one core (no team) unless it calls `use_cores()`, which only the engine loop
(the one thread that computes while serving) and short-lived threads (start-up) do. Both act on the
calling thread alone (OpenMP's thread count and MKL's thread-local one), after torch's own
per-thread set-up, which would otherwise reset them at the thread's first parallel op.
Where libgomp or MKL cannot be found (another torch build), this says so once in the log and the
thread keeps torch's default.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator
from functools import cache

import torch

logger = logging.getLogger(__name__)

_cores: int | None = None  # torch's thread count before `single_core_default` (None: never called)


def cores() -> int:
    """The cores a compute thread uses: torch's thread count as the process found it."""
    return _cores if _cores is not None else torch.get_num_threads()


def single_core_default() -> int:
    """Make one core the default of every thread that has not run a torch op yet, and of the calling
    thread; returns `cores()`. Idempotent. Call it from a process entry point before its threads start."""
    global _cores
    if _cores is None:
        _cores = torch.get_num_threads()
        torch.set_num_threads(1)
        logger.info("torch: one compute thread on %d cores, other threads on one", _cores)
    return _cores


def use_cores(n: int | None = None) -> None:
    """The calling thread runs torch ops on `n` cores (default `cores()`), whatever the default."""
    n = cores() if n is None else n
    if n < 1:
        raise ValueError(f"cores must be >= 1, not {n}")
    torch.get_num_threads()  # torch's per-thread set-up first: it would reset what follows
    omp, mkl = _omp(), _mkl_local()
    if omp is not None:
        omp.omp_set_num_threads(n)
    if mkl is not None:
        mkl(n)


def one_core() -> None:
    """The calling thread runs torch ops on one core: no OpenMP team of its own (helper threads)."""
    use_cores(1)


def thread_cores() -> int:
    """The cores the calling thread's parallel torch ops use."""
    return torch.get_num_threads()  # OpenMP's count for this thread


@contextlib.contextmanager
def cores_here(n: int) -> Iterator[None]:
    """`use_cores(n)` on the calling thread for the block, then its count before."""
    before = thread_cores()
    use_cores(n)
    try:
        yield
    finally:
        use_cores(before)


@cache
def _omp() -> ctypes.CDLL | None:
    """torch's libgomp (the copy torch loaded, not another package's), or None."""
    if not torch.backends.openmp.is_available():
        return None
    path = _loaded("libgomp")
    if path is None:
        logger.warning("torch's libgomp not found among the loaded libraries: per-thread core counts are off")
        return None
    return ctypes.CDLL(path)


@cache
def _mkl_local():
    """MKL's per-thread thread count setter inside torch (MKL_Set_Num_Threads_Local), or None."""
    if not torch.backends.mkl.is_available():
        return None
    path = _loaded("libtorch_cpu")
    fn = getattr(ctypes.CDLL(path), "MKL_Set_Num_Threads_Local", None) if path else None
    if fn is None:
        logger.warning("MKL's per-thread setting not found in torch: MKL keeps its process-wide thread count")
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def _loaded(name: str) -> str | None:
    """The path of a shared library torch loaded (torch/lib or torch.libs) whose file name starts with
    `name`; None when there is none or no /proc to ask (not Linux). /proc lists resolved paths, so
    torch's own is resolved too (a virtual environment reached through a symbolic link)."""
    torch_dir = os.path.realpath(os.path.dirname(torch.__file__ or ""))
    roots = (os.path.join(torch_dir, ""), torch_dir + ".libs" + os.sep)
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    return next((p for p in sorted(paths) if os.path.basename(p).startswith(name) and p.startswith(roots)), None)
