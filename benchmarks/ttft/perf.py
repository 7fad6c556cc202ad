"""TTFT per mode at growing context lengths, with the passage caches in RAM and on local disk."""

from __future__ import annotations

import logging
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common.data import Context, Example, build_context, shuffled
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.keys import store_fingerprint
from blend_engine.kv_store.factory import build_loader, build_store
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig, Mode

logger = logging.getLogger(__name__)

PERF_MODES: tuple[tuple[str, Mode, float | None], ...] = (
    ("prefix_cache", Mode.PREFIX_CACHE, None),
    ("full_reuse", Mode.FULL_REUSE, None),
    ("blend@0.15", Mode.BLEND, 0.15),
)
TIERS = ("ram", "disk")


@dataclass(frozen=True)
class PerfRow:
    tier: str
    mode: str
    target_tokens: int
    context_tokens: int
    ttft_ms: float
    load_ms: float
    recompute_ms: float
    speedup_vs_full_prefill: float


@contextmanager
def tier_engine(runner: ModelRunner, tier: str) -> Iterator[BlendEngine]:
    """An engine whose store keeps the caches in RAM, or on disk with a zero-byte memory tier."""
    fingerprint = store_fingerprint(runner.fingerprint, "fp16")
    with tempfile.TemporaryDirectory(prefix="blendbench-kv-") as tmp:
        if tier == "ram":
            store = build_store(memory_bytes=4 << 30, fingerprint=fingerprint)
        elif tier == "disk":
            store = build_store(memory_bytes=0, disk_dir=Path(tmp), fingerprint=fingerprint)
        else:
            raise ValueError(f"unknown tier {tier!r}")
        try:
            yield BlendEngine(runner, store, EngineConfig(prefix_caching=False), loader=build_loader(store))
        finally:
            store.close()


def ttft(engine: BlendEngine, plans: list[BlendPlan]) -> tuple[float, float, float]:
    """Median (ttft_ms, load_ms, recompute_ms) over one one-token generation per plan (one plan per
    trial: prefix_cache needs an order it has not cached yet every time)."""
    gen = GenerationConfig(max_tokens=1)
    results = []
    for plan in plans:
        results.append(engine.run(plan, gen))
    best = sorted(results, key=lambda r: r.ttft_ms)[len(results) // 2]
    return statistics.median(r.ttft_ms for r in results), best.report.load_ms, best.report.recompute_ms


def measure_context(runner: ModelRunner, ctx: Context, target: int, tiers: tuple[str, ...], trials: int) -> list[PerfRow]:
    """Full prefill once (no cache involved), then every cached mode per tier; speedups from the same run."""
    rows: list[PerfRow] = []
    full_ms = None
    for tier in tiers:
        with tier_engine(runner, tier) as engine:
            for p in ctx.passages:
                engine.ensure_cached(p)
            if full_ms is None:
                full_ms, _, rec = ttft(engine, [BlendPlan(ctx.passages, ctx.question, mode=Mode.FULL_PREFILL)] * trials)
                n = engine.layout(BlendPlan(ctx.passages, ctx.question)).n_tokens
                rows.append(PerfRow("-", "full_prefill", target, n, full_ms, 0.0, rec, 1.0))
            for name, mode, ratio in PERF_MODES:
                orders = [ctx.passages] * trials
                if mode is Mode.PREFIX_CACHE:  # warm in the original order, measure new shuffled ones
                    engine.run(BlendPlan(ctx.passages, ctx.question, mode=mode), GenerationConfig(max_tokens=1))
                    orders = [shuffled(ctx.passages, f"perf{target}" + (f"-{t}" if t else "")) for t in range(trials)]
                plans = [BlendPlan(order, ctx.question, mode=mode, recompute_ratio=ratio) for order in orders]
                ms, load, rec = ttft(engine, plans)
                rows.append(PerfRow(tier, name, target, rows[0].context_tokens if rows else 0, ms, load, rec, full_ms / ms))
                logger.info("perf %s %s @%d tokens: ttft %.0f ms (x%.2f)", tier, name, target, ms, full_ms / ms)
    n_ctx = next(r.context_tokens for r in rows if r.mode == "full_prefill")
    return [PerfRow(**{**asdict(r), "context_tokens": n_ctx}) for r in rows]


def run_perf(examples: list[Example], runner: ModelRunner, targets: tuple[int, ...], tiers: tuple[str, ...] = TIERS,
             trials: int = 1) -> list[PerfRow]:
    count = lambda text: len(runner.encode(text))  # noqa: E731
    rows: list[PerfRow] = []
    for i, target in enumerate(targets):
        ctx = build_context(examples, target, count, start=i)
        rows += measure_context(runner, ctx, target, tiers, trials)
    return rows
