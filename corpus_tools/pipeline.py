"""The corpus as the service and the CLI use it: ingestion (`corpus_tools.ingest`) and
maintenance (`corpus_tools.maintenance`): a `Corpus` (`corpus_tools.corpus`) with both.

This module is the service's one way into `corpus_tools` besides the document readers (see
tests/test_import_rules.py), so it also names the ingestion's public types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from blend_engine.cancel import StopCheck, never
from blend_engine.engine import BlendEngine
from corpus_tools.corpus import Corpus
from corpus_tools.documents import Document
from corpus_tools.ingest import DocumentRejected, Ingestion, IngestSummary, default_precompute_batch
from corpus_tools.maintenance import Maintenance, VerifyReport
from retrieval.embedder import Embedder
from retrieval.index import VectorIndex
from retrieval.passages import PassageStore

__all__ = ["DocumentRejected", "IngestPipeline", "IngestSummary", "VerifyReport"]


class IngestPipeline(Corpus):
    """The corpus with its ingestion and maintenance. Thread-safe: writes (ingest batches,
    deletes, verify, gc) are serialized by the corpus lock."""

    def __init__(self, engine: BlendEngine, embedder: Embedder, index: VectorIndex, db: PassageStore,
                 index_dir: Path, chunk_tokens: int = 256, batch_size: int = 32,
                 precompute_batch: int | None = None) -> None:
        """precompute_batch: passages per KV precompute forward; None = `default_precompute_batch`
        for the engine's device (1 on the CPU)."""
        super().__init__(engine, embedder, index, db, index_dir)
        if precompute_batch is None:
            precompute_batch = default_precompute_batch(engine.runner.device.type)
        self.ingestion = Ingestion(self, chunk_tokens, batch_size, precompute_batch)
        self.maintenance = Maintenance(self)

    @property
    def chunk_tokens(self) -> int:
        return self.ingestion.chunk_tokens

    @property
    def batch_size(self) -> int:
        return self.ingestion.batch_size

    @batch_size.setter
    def batch_size(self, n: int) -> None:
        self.ingestion.batch_size = n

    # ------------------------------------------------------------------ ingestion
    def ensure_system_prefix(self, should_stop: StopCheck = never) -> bool:
        return self.ingestion.ensure_system_prefix(should_stop)

    def ingest(self, docs: Iterable[Document], progress: bool = False, publish: str = "batch",
               before_commit: Callable[[], None] | None = None, strict: bool = False, *,
               should_stop: StopCheck = never, pace: Callable[[], None] | None = None) -> IngestSummary:
        """See `Ingestion.ingest` (`should_stop`: the caller's cancellation; `pace`: its yield point)."""
        return self.ingestion.ingest(docs, progress, publish, before_commit, strict, should_stop=should_stop,
                                     pace=pace)

    # ------------------------------------------------------------------ maintenance
    def get_document(self, doc_id: str) -> dict | None:
        return self.maintenance.get_document(doc_id)

    def delete_document(self, doc_id: str) -> bool:
        return self.maintenance.delete_document(doc_id)

    def verify(self, repair: bool = False, progress: bool = False) -> VerifyReport:
        return self.maintenance.verify(repair, progress)

    def gc(self) -> dict:
        return self.maintenance.gc()

    def stats(self) -> dict:
        """Passage counts, the index, the KV format and its stored bytes per token (from the codec)."""
        counts = self.db.counts()
        return {
            **counts,
            "incomplete_documents": len(self.db.incomplete()),
            "index": {"kind": self.index.kind, "configured": self.index.params.kind, "vectors": len(self.index),
                      "dim": self.index.dim, "embedder": self.embedder.name},
            "kv": {"format": self.engine.config.kv_format, "bytes_per_token": self.kv_bytes_per_token(),
                   "bytes_estimate": self.kv_estimate(counts["passages"], counts["tokens"]),
                   "store": self.store.stats().as_dict()},
            "model": self.engine.runner.name,
            "chunk_tokens": self.chunk_tokens,
        }
