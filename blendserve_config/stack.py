"""The composition root: the heavy objects, built once (service lifespan / CLI start) from `Settings`,
and the one first-start ingestion of the bundled sample corpus."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from blend_engine.cancel import Cancelled, StopCheck, never
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.kv_pool import DEFAULT_POOL_BYTES, block_bytes, pool_bytes
from blend_engine.keys import store_fingerprint
from blend_engine.kv_store import KVStore
from blend_engine.kv_store.codec import resolve_format
from blend_engine.kv_store.factory import build_loader, build_store
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.batch import BatchLimits
from blend_engine.scheduler.controller import BandwidthController
from blend_engine.selfcheck import GateDecision
from blendserve_config.settings import Settings
from corpus_tools.documents import Reader
from corpus_tools.ingest import IngestSummary
from corpus_tools.pipeline import IngestPipeline
from retrieval.embedder import Embedder
from retrieval.index import IndexParams
from retrieval.lexical import Fusion
from retrieval.passages import open_passage_store
from retrieval.retriever import Retriever, open_index
from retrieval.sync import IndexSync

logger = logging.getLogger(__name__)

DB_FILE = "passages.sqlite3"


@dataclass
class Stack:
    settings: Settings
    runner: ModelRunner
    store: KVStore
    engine: BlendEngine
    retriever: Retriever
    pipeline: IngestPipeline
    sync: IndexSync | None = None
    gate: GateDecision | None = None  # the start-up fidelity gate's outcome (set by the service)
    gate_checking: bool = False  # the gate is running (in the background): blend is not yet decided

    def start_sync(self) -> IndexSync | None:
        """Follow the passage store's change log (other replicas', the CLI's ingestions) on a thread."""
        if self.sync is not None:
            self.sync.start()
        return self.sync

    def close(self) -> None:
        """Stop index sync, persist the index, close the passage store and the KV store. Safe to call twice."""
        if self.sync is not None:
            self.sync.stop()
        self.engine.close()
        try:
            self.pipeline.save_index()
        except OSError as exc:
            logger.warning("could not save the index on close: %s", exc)
        self.pipeline.db.close()
        self.store.close()


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def index_params(settings: Settings) -> IndexParams:
    r = settings.retrieval
    return IndexParams(kind=r.index_type, hnsw_m=r.hnsw_m, hnsw_ef_search=r.hnsw_ef_search, ivf_nlist=r.ivf_nlist,
                       ivf_nprobe=r.ivf_nprobe, ivf_min_train=r.ivf_min_train)


def build_store_from(settings: Settings, fingerprint: str = "", device: str | None = None) -> KVStore:
    """The KV tiers from settings; with the engine's `device`, a device tier sized by
    BLENDSERVE_STORE_DEVICE_CACHE_GB (automatic when unset; a value the device cannot honour fails here)."""
    kwargs = {"fingerprint": fingerprint} if fingerprint else {}
    device_bytes = 0
    if device is not None:
        from blend_engine.kv_store.device import device_cache_bytes

        device_bytes = device_cache_bytes(settings.store.device_cache_gb, device,
                                          reserved_bytes=(settings.engine.batch_kv_mb or DEFAULT_POOL_BYTES >> 20) << 20)
    return build_store(
        kv_format=settings.store.kv_format,
        memory_bytes=settings.store.memory_cache_bytes,
        device_bytes=device_bytes,
        device=device,
        disk_dir=settings.kv_dir,
        disk_bytes=settings.store.disk_cache_mb << 20,
        disk_direct_io=settings.store.disk_direct_io,
        redis_url=settings.store.redis_url,
        redis_timeout_s=settings.store.redis_timeout_s,
        **kwargs,
    )


def build_controller(settings: Settings, runner: ModelRunner | None = None) -> BandwidthController | None:
    """The bandwidth-aware ratio controller when no fixed ratio is configured (None if unavailable);
    with the `runner`, its start-up estimates are measured once on the runner's device
    (`transfer.calibrate`: a small staged read, copy and upload, a small layer forward)."""
    if settings.engine.recompute_ratio is not None:
        return None
    calibrate = None
    if runner is not None:
        from blend_engine.transfer import calibrate as measure

        fmt = resolve_format(settings.store.kv_format, runner.dtype, runner.device.type)
        calibrate = functools.partial(measure, runner, fmt, workdir=settings.kv_dir)  # the disk tier's file system
    return BandwidthController(floor=settings.engine.ratio_floor, cap=settings.engine.ratio_max, calibrate=calibrate)


def queue_limit(settings: Settings) -> int | None:
    """BLENDSERVE_SERVICE_MAX_QUEUE for the service's settings; None (no bound) for the CLI's, which
    have no service group and submit one request at a time."""
    service = getattr(settings, "service", None)
    return None if service is None else service.max_queue


def kv_pool_mb(settings: Settings, runner: ModelRunner) -> int:
    """The KV pool's size in MiB: BLENDSERVE_ENGINE_BATCH_KV_MB, or the automatic size (`kv_pool.pool_bytes`)."""
    e = settings.engine
    auto = e.batch_kv_mb is None or (runner.device.type == "cuda" and e.kv_pool_gpu_fraction is not None)
    mb = pool_bytes(runner.device, None if e.batch_kv_mb is None else e.batch_kv_mb << 20, e.kv_pool_gpu_fraction,
                    block_bytes(runner, e.kv_block_tokens), set_aside=settings.store.memory_cache_bytes) >> 20
    logger.info("KV pool: %d MiB (%s)", mb, "automatic" if auto else "BLENDSERVE_ENGINE_BATCH_KV_MB")
    return max(mb, 1)


def build_engine(settings: Settings, runner: ModelRunner, store: KVStore) -> BlendEngine:
    e = settings.engine
    if e.batch_kv_mb is None:
        e = e.model_copy(update={"batch_kv_mb": kv_pool_mb(settings, runner)})
    config = EngineConfig(kv_format=settings.store.kv_format,
                          default_ratio=e.recompute_ratio if e.recompute_ratio is not None else e.ratio_floor,
                          selected_attention=e.selected_attention, decode_attention=e.decode_attention,
                          decode_graphs=e.decode_graphs,
                          batch=BatchLimits(e.max_batch, e.batch_kv_mb << 20, e.prefill_step_tokens, e.kv_block_tokens,
                                            max_queue=queue_limit(settings), prefill_step_s=_seconds(e.prefill_step_ms)),
                          prefix_caching=e.prefix_caching)
    return BlendEngine(runner, store, config, loader=build_loader(store),
                       controller=build_controller(settings, runner))


def fusion_of(settings: Settings) -> Fusion:
    """How hybrid retrieval fuses its two lists (BLENDSERVE_RETRIEVAL_HYBRID_*)."""
    r = settings.retrieval
    return Fusion(r.hybrid_fusion, r.hybrid_dense_weight, r.hybrid_rrf_k, r.hybrid_candidates)


def build_reranker(settings: Settings):
    """The CrossEncoder named by BLENDSERVE_RETRIEVAL_RERANKER (a local folder), or None."""
    if settings.retrieval.reranker is None:
        return None
    from retrieval.rerank import Reranker

    return Reranker(settings.retrieval.reranker)


def build_stack(settings: Settings, runner: ModelRunner | None = None, embedder: Embedder | None = None,
                store: KVStore | None = None) -> Stack:
    """Everything from settings; `runner`, `embedder` and `store` may be passed in (tests, reuse)."""
    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    runner = runner or ModelRunner.load(settings.model.name, settings.model.device, settings.model.dtype,
                                          settings.model.cache_dir, settings.model.linear_dtype,
                                          settings.model.packed_weights)
    fmt = resolve_format(settings.store.kv_format, runner.dtype, runner.device.type)
    pool_mb = kv_pool_mb(settings, runner)
    settings = settings.model_copy(update={"store": settings.store.model_copy(update={"kv_format": fmt}),
                                           "engine": settings.engine.model_copy(update={"batch_kv_mb": pool_mb})})
    store = store or build_store_from(settings, store_fingerprint(runner.fingerprint, settings.store.kv_format),
                                      device=str(runner.device))
    engine = build_engine(settings, runner, store)
    embedder = embedder or Embedder(settings.retrieval.embedder, batch_size=settings.ingest.embed_batch_size)
    db = open_passage_store(settings.store.database_url, data_dir, DB_FILE)
    index, info = open_index(data_dir, db, embedder, index_params(settings))
    logger.info("index: %d vectors (%s; loaded=%s, reconciled +%d -%d; passage store %s at generation %d)",
                len(index), index.kind, info["loaded"], info["added"], info["removed"], db.describe(),
                info["generation"])
    r, ing = settings.retrieval, settings.ingest
    retriever = Retriever(embedder, index, db, r.placement, mode=r.method, fusion=fusion_of(settings),
                          title_weight=r.lexical_title_weight, reranker=build_reranker(settings))
    pipeline = IngestPipeline(engine, embedder, index, db, data_dir, ing.chunk_tokens, ing.batch_size,
                              ing.precompute_batch)
    sync = IndexSync(index, db, embedder, info["generation"], settings.retrieval.index_sync_interval_s, start_info=info)
    return Stack(settings, runner, store, engine, retriever, pipeline, sync)


def _is_empty(stack: Stack) -> bool:
    """First start: nothing ingested yet (an empty data dir, or a first start cut short)."""
    return stack.pipeline.db.counts()["passages"] == 0


def sample_to_ingest(stack: Stack) -> Path | None:
    """Settings.ingest.sample_corpus when enabled, present, and nothing is stored yet (the first start); else None."""
    s = stack.settings
    if not s.ingest.sample_on_start or s.ingest.sample_corpus is None or not _is_empty(stack):
        return None
    path = Path(s.ingest.sample_corpus)
    if not path.is_file():
        logger.warning("sample corpus %s not found; starting with an empty corpus", path)
        return None
    return path


def ingest_sample_on_first_start(stack: Stack, should_stop: StopCheck = never,
                                 progress: bool = False) -> IngestSummary | None:
    """Ingest Settings.ingest.sample_corpus when enabled and nothing is stored yet: one ingestion, published
    batch by batch, that `should_stop` interrupts at its next checkpoint (between layers and batches;
    what was published stays). The summary; None when skipped or interrupted. (The service runs the
    same ingestion as a background job instead, `app.startup.submit_sample`.)"""
    path = sample_to_ingest(stack)
    if path is None:
        return None
    docs = list(Reader().read([path]))
    t0 = time.perf_counter()
    logger.info("first start: ingesting %d sample documents from %s", len(docs), path)
    try:
        summary = stack.pipeline.ingest(docs, progress=progress, should_stop=should_stop)
    except Cancelled:
        logger.info("sample ingestion interrupted by shutdown after %.1f s (%d passages published)",
                    time.perf_counter() - t0, stack.pipeline.db.counts()["passages"])
        return None
    for err in summary.errors:
        logger.warning("sample ingestion: %s", err)
    logger.info("sample ingestion: %d documents, %d passages in %.1f s", len(docs), summary.new_passages,
                time.perf_counter() - t0)
    return summary
