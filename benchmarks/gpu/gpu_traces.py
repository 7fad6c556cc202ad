"""The GPU check's profile part (issue #57 item 4): a torch.profiler trace of one blend@0.15 from each
KV tier the TTFT part blends from (`gpu_timing.tier_stores`) and of one batched run (a few concurrent
blended requests, `gpu_batch`), each after one warm-up of the same call, summarised by `gpu_profile`
(top kernels, launch count, device busy time against the wall time, idle gaps between kernels). The
chrome traces go gzipped into one tar in the check's folder while it stays under `TRACE_BYTES`
(the device tool brings back few files, each at most 16 MiB)."""

from __future__ import annotations

import gzip
import io
import logging
import re
import tarfile
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from benchmarks.gpu.gpu_batch import batched_engine, run_level
from benchmarks.gpu.gpu_common import QUESTIONS, Setup, profiled
from benchmarks.gpu.gpu_profile import summarise, trace_of
from benchmarks.gpu.gpu_timing import recorded, tier_engine, tier_stores
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan

logger = logging.getLogger("gpu_check")
RATIO = 0.15
CLIENTS, DECODE_TOKENS = 4, 8  # the batched run's size: a few concurrent requests, a few tokens each
TRACE_TAR = "gpu_profile_traces.tar"
TRACE_BYTES = 15 << 20


class TraceTar:
    """Chrome traces, gzipped, appended to one tar while it stays under `limit` bytes."""

    def __init__(self, path: Path, limit: int = TRACE_BYTES) -> None:
        self.path, self.limit = path, limit
        path.unlink(missing_ok=True)

    def add(self, name: str, prof) -> str:
        """The profiler's chrome trace as `name`.json.gz; what became of it (the member, or why not)."""
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            data = gzip.compress(raw.read_bytes(), compresslevel=6)
        size = self.path.stat().st_size if self.path.exists() else 0
        if size + len(data) + 4096 > self.limit:
            return f"skipped: {len(data) / 2**20:.1f} MiB gzipped, {size / 2**20:.1f} MiB already in {self.path.name}"
        member = re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ".json.gz"
        info = tarfile.TarInfo(member)
        info.size = len(data)
        with tarfile.open(self.path, "a") as tar:
            tar.addfile(info, io.BytesIO(data))
        return f"{self.path.name}:{member}"


def profile_runs(setup: Setup, runner: ModelRunner, n: int, tmp: Path, out: Path | None) -> dict:
    """One blend@0.15 of ~n tokens from each tier, then the batched run of `CLIENTS` such requests
    decoding `DECODE_TOKENS` each; a run that fails is recorded in its entry (`profile_error`)."""
    t0 = time.perf_counter()
    traces = TraceTar(out / TRACE_TAR) if out is not None else None
    with tempfile.TemporaryDirectory(dir=tmp, prefix="profile_") as root:
        runs = _profile_tiers(setup, runner, n, Path(root), traces)
    runs["batched"] = recorded("profile", lambda: _profile_batched(setup, runner, n, traces))
    return {"tokens": n, "ratio": RATIO, "clients": CLIENTS, "decode_tokens": DECODE_TOKENS, "runs": runs,
            "seconds": time.perf_counter() - t0}


def _profile_tiers(setup: Setup, runner: ModelRunner, n: int, root: Path, traces: TraceTar | None) -> dict:
    stores, passages = tier_stores(setup, runner, n, root)
    plan = BlendPlan(tuple(passages), QUESTIONS[0], mode="blend", recompute_ratio=RATIO)
    runs = {}
    for tier, store in stores.items():
        engine = tier_engine(runner, store)
        name = f"blend@{RATIO} {tier}"
        blend = partial(engine.prefill, plan)
        runs[name] = recorded("profile", lambda f=blend, name=name: _profile_one(setup, f, name, traces))
    return runs


def _profile_batched(setup: Setup, runner: ModelRunner, n: int, traces: TraceTar | None) -> dict:
    engine, plans, gen = batched_engine(setup, runner, CLIENTS, n, DECODE_TOKENS)
    try:
        return _profile_one(setup, lambda: run_level(engine, plans, gen), "batched", traces)
    finally:
        engine.close()


def _profile_one(setup: Setup, fn: Callable[[], object], name: str, traces: TraceTar | None) -> dict:
    """`fn` warmed up, then profiled (every thread's ops) and summarised; `seconds`: all of it, the
    trace's parsing and export included."""
    t0 = time.perf_counter()
    prof, wall_ms = profiled(setup, fn, all_threads=True)
    summary = summarise(trace_of(prof.events(), setup.device.type == "cuda"), wall_ms)
    if traces is not None:
        summary["trace"] = traces.add(name, prof)
    summary["seconds"] = time.perf_counter() - t0
    logger.info("profile %s: %.1f ms, %d launches, busy %.0f%%, %d gaps > %.0f us (%.2f ms), %.1f s", name, wall_ms,
                summary["launches"], 100 * summary["busy_share"], summary["gaps"], summary["gap_us"],
                summary["gap_ms"], summary["seconds"])
    return summary
