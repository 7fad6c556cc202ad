"""The composition root: the heavy objects, built once (service lifespan / CLI start) from `Settings`,
and the one first-start ingestion of the bundled sample corpus."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from blend_engine.cancel import Cancelled, cancel_scope
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.keys import store_fingerprint
from blend_engine.kv_store import KVStore
from blend_engine.kv_store.codec import resolve_format
from blend_engine.kv_store.factory import build_loader, build_store
from blend_engine.model import ModelRunner
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


def index_params(settings: Settings) -> IndexParams:
    return IndexParams(kind=settings.index_type, hnsw_m=settings.hnsw_m, hnsw_ef_search=settings.hnsw_ef_search,
                       ivf_nlist=settings.ivf_nlist, ivf_nprobe=settings.ivf_nprobe,
                       ivf_min_train=settings.ivf_min_train)


def build_store_from(settings: Settings, fingerprint: str = "", device: str | None = None) -> KVStore:
    """The KV tiers from settings; with the engine's `device`, a device tier sized by
    BLENDSERVE_DEVICE_CACHE_GB (automatic when unset; a value the device cannot honour fails here)."""
    kwargs = {"fingerprint": fingerprint} if fingerprint else {}
    device_bytes = 0
    if device is not None:
        from blend_engine.kv_store.device import device_cache_bytes

        device_bytes = device_cache_bytes(settings.device_cache_gb, device, reserved_bytes=settings.batch_kv_mb << 20)
    return build_store(
        kv_format=settings.kv_format,
        memory_bytes=settings.memory_cache_bytes,
        device_bytes=device_bytes,
        device=device,
        disk_dir=settings.kv_dir,
        disk_bytes=settings.disk_cache_mb << 20,
        disk_direct_io=settings.disk_direct_io,
        redis_url=settings.redis_url,
        redis_timeout_s=settings.redis_timeout_s,
        **kwargs,
    )


def build_controller(settings: Settings, runner: ModelRunner | None = None) -> BandwidthController | None:
    """The bandwidth-aware ratio controller when no fixed ratio is configured (None if unavailable);
    with the `runner`, its start-up estimates are measured once on the runner's device
    (`transfer.calibrate`: a small staged read, copy and upload, a small layer forward)."""
    if settings.recompute_ratio is not None:
        return None
    calibrate = None
    if runner is not None:
        from blend_engine.transfer import calibrate as measure

        fmt = resolve_format(settings.kv_format, runner.dtype, runner.device.type)
        calibrate = functools.partial(measure, runner, fmt, workdir=settings.kv_dir)  # the disk tier's file system
    return BandwidthController(floor=settings.ratio_floor, cap=settings.ratio_max, calibrate=calibrate)


def build_engine(settings: Settings, runner: ModelRunner, store: KVStore) -> BlendEngine:
    config = EngineConfig(kv_format=settings.kv_format, prefix_cache_bytes=settings.prefix_cache_mb << 20,
                          default_ratio=settings.recompute_ratio if settings.recompute_ratio is not None
                          else settings.ratio_floor, selected_attention=settings.selected_attention,
                          batch=BatchLimits(settings.max_batch, settings.batch_kv_mb << 20, settings.prefill_step_tokens))
    return BlendEngine(runner, store, config, loader=build_loader(store),
                       controller=build_controller(settings, runner))


def fusion_of(settings: Settings) -> Fusion:
    """How hybrid retrieval fuses its two lists (BLENDSERVE_HYBRID_*)."""
    return Fusion(settings.hybrid_fusion, settings.hybrid_dense_weight, settings.hybrid_rrf_k,
                  settings.hybrid_candidates)


def build_reranker(settings: Settings):
    """The CrossEncoder named by BLENDSERVE_RERANKER (a local folder), or None."""
    if settings.reranker is None:
        return None
    from retrieval.rerank import Reranker

    return Reranker(settings.reranker)


def build_stack(settings: Settings, runner: ModelRunner | None = None, embedder: Embedder | None = None,
                store: KVStore | None = None) -> Stack:
    """Everything from settings; `runner`, `embedder` and `store` may be passed in (tests, reuse)."""
    data_dir = settings.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    runner = runner or ModelRunner.load(settings.model, settings.device, settings.dtype, settings.model_cache_dir)
    settings = settings.model_copy(update={"kv_format": resolve_format(settings.kv_format, runner.dtype,
                                                                       runner.device.type)})
    store = store or build_store_from(settings, store_fingerprint(runner.fingerprint, settings.kv_format),
                                      device=str(runner.device))
    engine = build_engine(settings, runner, store)
    embedder = embedder or Embedder(settings.embedder, batch_size=settings.embed_batch_size)
    db = open_passage_store(settings.database_url, data_dir, DB_FILE)
    index, info = open_index(data_dir, db, embedder, index_params(settings))
    logger.info("index: %d vectors (%s; loaded=%s, reconciled +%d -%d; passage store %s at generation %d)",
                len(index), index.kind, info["loaded"], info["added"], info["removed"], db.describe(),
                info["generation"])
    retriever = Retriever(embedder, index, db, settings.placement, mode=settings.retrieval, fusion=fusion_of(settings),
                          title_weight=settings.lexical_title_weight, reranker=build_reranker(settings))
    pipeline = IngestPipeline(engine, embedder, index, db, data_dir, settings.chunk_tokens, settings.ingest_batch_size,
                              settings.precompute_batch)
    sync = IndexSync(index, db, embedder, info["generation"], settings.index_sync_interval_s, start_info=info)
    return Stack(settings, runner, store, engine, retriever, pipeline, sync)


def _is_empty(stack: Stack) -> bool:
    """First start: nothing ingested yet (an empty data dir, or a first start cut short)."""
    return stack.pipeline.db.counts()["passages"] == 0


def sample_to_ingest(stack: Stack) -> Path | None:
    """Settings.sample_corpus when enabled, present, and nothing is stored yet (the first start); else None."""
    s = stack.settings
    if not s.ingest_sample_on_start or s.sample_corpus is None or not _is_empty(stack):
        return None
    path = Path(s.sample_corpus)
    if not path.is_file():
        logger.warning("sample corpus %s not found; starting with an empty corpus", path)
        return None
    return path


def ingest_sample_on_first_start(stack: Stack, should_stop: Callable[[], bool] = lambda: False,
                                 progress: bool = False) -> IngestSummary | None:
    """Ingest Settings.sample_corpus when enabled and nothing is stored yet: one ingestion, published
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
        with cancel_scope(should_stop):
            summary = stack.pipeline.ingest(docs, progress=progress)
    except Cancelled:
        logger.info("sample ingestion interrupted by shutdown after %.1f s (%d passages published)",
                    time.perf_counter() - t0, stack.pipeline.db.counts()["passages"])
        return None
    for err in summary.errors:
        logger.warning("sample ingestion: %s", err)
    logger.info("sample ingestion: %d documents, %d passages in %.1f s", len(docs), summary.new_passages,
                time.perf_counter() - t0)
    return summary
