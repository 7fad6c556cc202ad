"""Prometheus metrics on a per-app registry (several apps can live in one process)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blend_engine.kv_store.base import KVStore
from blend_engine.scheduler.plans import RatioSource
from blend_engine.types import BlendReport

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)


class _StoreCollector(Collector):
    """Reads the KV store's own counters at scrape time: hits and misses per tier."""

    def __init__(self, get_store: Callable[[], KVStore | None]) -> None:
        self._get_store = get_store

    def collect(self) -> Iterable[Metric]:
        hits = CounterMetricFamily("blendserve_kv_store_hits", "KV store hits per tier", labels=["tier"])
        misses = CounterMetricFamily("blendserve_kv_store_misses", "KV store misses per tier", labels=["tier"])
        used = GaugeMetricFamily("blendserve_kv_store_bytes", "Bytes held per tier", labels=["tier"])
        entries = GaugeMetricFamily("blendserve_kv_store_entries", "Entries held per tier", labels=["tier"])
        store = self._get_store()
        if store is not None:
            for tier in store.tiers:
                try:
                    st = tier.stats()
                except Exception:  # noqa: BLE001 - a scrape must never fail on a flaky tier
                    logger.debug("stats() failed for a store tier", exc_info=True)
                    continue
                hits.add_metric([st.name], st.hits)
                misses.add_metric([st.name], st.misses)
                used.add_metric([st.name], st.bytes_used)
                entries.add_metric([st.name], st.entries)
        yield from (hits, misses, used, entries)


class _SyncCollector(Collector):
    """The replica's FAISS index against the passage store's change log, read at scrape time."""

    def __init__(self, get_sync: Callable[[], object | None]) -> None:
        self._get_sync = get_sync

    def collect(self) -> Iterable[Metric]:
        sync = self._get_sync()
        if sync is None:
            return
        st = sync.status()
        yield GaugeMetricFamily("blendserve_index_generation", "Last passage-store change applied to this "
                                "replica's index", value=st.generation)
        yield GaugeMetricFamily("blendserve_index_store_head", "Newest passage-store change seen", value=st.head)
        yield GaugeMetricFamily("blendserve_index_lag_changes", "Passage-store changes not yet in this replica's "
                                "index", value=st.lag_changes)
        yield GaugeMetricFamily("blendserve_index_lag_seconds", "Age of the oldest change not yet in this "
                                "replica's index", value=st.lag_s)
        yield GaugeMetricFamily("blendserve_index_vectors", "Vectors in this replica's index", value=len(sync.index))
        yield GaugeMetricFamily("blendserve_index_sync_ok", "1 when the last change-log poll succeeded",
                                value=0 if st.error else 1)


class _BatchCollector(Collector):
    """The engine loop's continuous batch, read at scrape time."""

    def __init__(self, get_loop: Callable[[], object | None]) -> None:
        self._get_loop = get_loop

    def collect(self) -> Iterable[Metric]:
        loop = self._get_loop()
        if loop is None:
            return
        st = loop.stats()
        for family, name, doc, key in _LOOP_SERIES:
            yield family(name, doc, value=st[key])
        steps = CounterMetricFamily("blendserve_engine_steps", "Engine steps by kind: decode (decode rows only), "
                                    "prefill (carrying prefill rows)", labels=["kind"])
        seconds = CounterMetricFamily("blendserve_engine_step_seconds", "Wall time of engine steps by kind",
                                      labels=["kind"])
        for kind, n in sorted(st["steps_by_kind"].items()):
            steps.add_metric([kind], n)
            seconds.add_metric([kind], st["step_seconds_by_kind"][kind])
        yield steps
        yield seconds
        yield CounterMetricFamily("blendserve_engine_step_cpu_seconds", "The process's CPU time while engine steps "
                                  "ran; over their wall time, the cores kept busy", value=st["step_cpu_seconds"])
        decisions = CounterMetricFamily("blendserve_admission", "Admission decisions by reason: admitted, refused "
                                        "(queue full, too slow, shutting down), dropped too late, waited (batch "
                                        "full, KV blocks, the step's prefill budget); "
                                        "`blend_engine.scheduler.admission`", labels=["decision"])
        for decision, count in sorted(loop.admission.decisions.items()):
            decisions.add_metric([decision], count)
        yield decisions

_LOOP_SERIES = (  # the engine loop's stats() as metric families: (family, name, help, stats key)
    (GaugeMetricFamily, "blendserve_queue_depth", "Requests queued for the engine's batch (admitted, not started)",
     "queued_requests"),
    (GaugeMetricFamily, "blendserve_engine_busy", "Requests in the engine's batch (each with its n sequences)",
     "running_requests"),
    (GaugeMetricFamily, "blendserve_batch_running", "Requests prefilling or decoding in the engine loop", "running"),
    (GaugeMetricFamily, "blendserve_batch_waiting", "Requests waiting for a place in the batch", "waiting"),
    (GaugeMetricFamily, "blendserve_batch_kv_bytes", "KV pool memory held by running requests", "kv_bytes"),
    (CounterMetricFamily, "blendserve_decode_steps", "Batched decode steps run", "decode_steps"),
    (CounterMetricFamily, "blendserve_engine_prefill_token_layers", "Prefill rows summed over the layers they "
     "entered (the unit of ENGINE_PREFILL_STEP_TOKENS); prefill steps' seconds over it: the prefill work's rate",
     "prefill_token_layers"),
    (GaugeMetricFamily, "blendserve_engine_prefill_step_budget", "The prefill work (token-layers) a step may "
     "carry while others decode now: ENGINE_PREFILL_STEP_TOKENS, cut to what ENGINE_PREFILL_STEP_MS buys at the "
     "measured cost", "prefill_step_budget"),
    (GaugeMetricFamily, "blendserve_kv_pool_blocks", "Blocks of the paged KV pool", "kv_blocks"),
    (GaugeMetricFamily, "blendserve_kv_pool_blocks_in_use", "KV pool blocks held by running requests",
     "kv_blocks_in_use"),
    (GaugeMetricFamily, "blendserve_kv_pool_blocks_cached", "KV pool blocks holding cached prefixes (evictable)",
     "kv_blocks_cached"),
    (CounterMetricFamily, "blendserve_kv_pool_evictions", "Cached prefix blocks of the KV pool taken for other "
     "requests (the least recently released or reused first)", "kv_blocks_evicted"),
    (CounterMetricFamily, "blendserve_preemptions", "Requests preempted because the KV pool was full", "preemptions"),
    (CounterMetricFamily, "blendserve_prefix_hit_tokens", "Prompt tokens taken from the KV pool's prefix cache",
     "prefix_hit_tokens"),
    (GaugeMetricFamily, "blendserve_decode_graphs", "Decode steps captured as CUDA graphs (one per batch size and "
     "key-length bucket; 0 on the CPU)", "decode_graphs"),
    (GaugeMetricFamily, "blendserve_kv_store_queued", "Missed passages queued for storing after their answers "
     "(the engine loop's background work)", "store_queued"),
    (CounterMetricFamily, "blendserve_kv_store_background", "Missed passages stored after their answers",
     "store_done"),
    (CounterMetricFamily, "blendserve_kv_store_background_failures", "Missed passages whose storing failed "
     "(logged; their answers were out already)", "store_failed"),
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "blendserve_requests", "Answered requests by endpoint and outcome", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "blendserve_ttft_seconds", "Time to first token per mode", ["mode"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "blendserve_request_latency_seconds", "End-to-end query latency per mode", ["mode"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.cache_lookups = Counter(
            "blendserve_passage_cache_lookups", "Passage KV lookups made by queries (tier=engine) by result",
            ["tier", "result"], registry=r,
        )
        self.recomputed_tokens = Counter(
            "blendserve_recomputed_tokens", "Prompt tokens recomputed per mode", ["mode"], registry=r
        )
        self.context_tokens = Counter(
            "blendserve_context_tokens", "Prompt tokens processed per mode", ["mode"], registry=r
        )
        self.ratio = Histogram(
            "blendserve_recompute_ratio", "Chosen recompute ratio per mode", ["mode"], buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.last_ratio = Gauge("blendserve_recompute_ratio_last", "Last chosen blend ratio", registry=r)
        self.rejected = Counter("blendserve_rejected", "Requests refused because the queue was full", registry=r)
        self.timeouts = Counter("blendserve_timeouts", "Requests that ran past the request timeout", registry=r)
        self.ingested = Counter("blendserve_ingested_passages", "Passages ingested online", registry=r)
        self.storage_errors = Counter("blendserve_storage_errors", "Requests failed by a storage fault (5xx)",
                                      registry=r)
        self._add_fidelity_gate(r)
        self.full_prefill_fallbacks = Counter(
            "blendserve_full_prefill_fallbacks",
            "Blend requests the controller served by full prefill (loading the KV would be slower)", registry=r,
        )

    def _add_fidelity_gate(self, r: CollectorRegistry) -> None:
        """The start-up fidelity gate's series (`set_fidelity`) and the fallbacks a failed gate causes."""
        self.fidelity_kl = Gauge("blendserve_fidelity_kl", "Start-up probe: mean first-token KL vs full prefill",
                                 ["mode"], registry=r)
        self.fidelity_top1 = Gauge("blendserve_fidelity_top1_agreement",
                                   "Start-up probe: greedy first token equal to full prefill's (share)", ["mode"],
                                   registry=r)
        self.fidelity_passed = Gauge("blendserve_fidelity_gate_passed",
                                     "1 passed, 0 failed, -1 not run (off or error)", registry=r)
        self.fidelity_fallback = Gauge("blendserve_blend_fallback_active",
                                       "1 while blend requests are answered with full prefill (gate failed)",
                                       registry=r)
        self.blend_fallbacks = Counter("blendserve_blend_fallbacks",
                                       "Blend requests answered with full prefill because the gate failed",
                                       registry=r)

    def set_fidelity(self, decision) -> None:
        """Publish the start-up fidelity gate's outcome (a `GateDecision`)."""
        result = decision.result
        self.fidelity_passed.set(-1 if result is None else int(result.passed))
        self.fidelity_fallback.set(int(decision.fallback))
        if result is not None:
            self.fidelity_kl.labels("blend").set(result.kl_blend)
            self.fidelity_kl.labels("full_reuse").set(result.kl_full_reuse)
            self.fidelity_top1.labels("blend").set(result.top1_blend)
            self.fidelity_top1.labels("full_reuse").set(result.top1_full_reuse)
            self.fidelity_kl.labels("blend_long").set(result.kl_blend_long)  # the long-passage probe
            self.fidelity_kl.labels("full_reuse_long").set(result.kl_full_reuse_long)
            self.fidelity_top1.labels("blend_long").set(result.top1_blend_long)
            self.fidelity_top1.labels("full_reuse_long").set(result.top1_full_reuse_long)

    def bind_store(self, get_store: Callable[[], object | None]) -> None:
        self.registry.register(_StoreCollector(get_store))

    def bind_sync(self, get_sync: Callable[[], object | None]) -> None:
        self.registry.register(_SyncCollector(get_sync))

    def bind_batch(self, get_loop: Callable[[], object | None]) -> None:
        self.registry.register(_BatchCollector(get_loop))

    def observe_query(self, report: BlendReport, ttft_ms: float, total_ms: float) -> None:
        mode = report.mode
        self.ttft.labels(mode).observe(ttft_ms / 1e3)
        self.latency.labels(mode).observe(total_ms / 1e3)
        self.cache_lookups.labels("engine", "hit").inc(report.cache_hits)
        self.cache_lookups.labels("engine", "miss").inc(report.cache_misses)
        self.recomputed_tokens.labels(mode).inc(report.recomputed_tokens)
        self.context_tokens.labels(mode).inc(report.context_tokens)
        self.ratio.labels(mode).observe(report.recompute_ratio)
        if mode == "blend":
            self.last_ratio.set(report.recompute_ratio)
        if report.ratio_source == RatioSource.FULL_PREFILL.value:
            self.full_prefill_fallbacks.inc()
