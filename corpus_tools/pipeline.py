"""The corpus as the service and the CLI use it: ingestion (`corpus_tools.ingest`) and
maintenance (`corpus_tools.maintenance`) over one `Corpus` (`corpus_tools.corpus`).

This module is the service's one way into `corpus_tools` besides the document readers (see
tests/test_import_rules.py), so it also names the ingestion's public types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from blend_engine.engine import BlendEngine
from corpus_tools.corpus import Corpus
from corpus_tools.documents import Document
from corpus_tools.ingest import DocumentRejected, Ingestion, IngestSummary
from corpus_tools.maintenance import Maintenance, VerifyReport
from retrieval.embedder import Embedder
from retrieval.index import VectorIndex
from retrieval.passages import PassageStore

__all__ = ["DocumentRejected", "IngestPipeline", "IngestSummary", "VerifyReport"]


class IngestPipeline:
    """Thread-safe: writes (ingest batches, deletes, verify, gc) are serialized by the corpus lock."""

    def __init__(self, engine: BlendEngine, embedder: Embedder, index: VectorIndex, db: PassageStore,
                 index_dir: Path, chunk_tokens: int = 256, batch_size: int = 32) -> None:
        self.corpus = Corpus(engine, embedder, index, db, index_dir)
        self.ingestion = Ingestion(self.corpus, chunk_tokens, batch_size)
        self.maintenance = Maintenance(self.corpus)

    # ------------------------------------------------------------------ the parts
    @property
    def engine(self) -> BlendEngine:
        return self.corpus.engine

    @property
    def embedder(self) -> Embedder:
        return self.corpus.embedder

    @property
    def index(self) -> VectorIndex:
        return self.corpus.index

    @property
    def db(self) -> PassageStore:
        return self.corpus.db

    @property
    def index_dir(self) -> Path:
        return self.corpus.index_dir

    @property
    def store(self):
        return self.corpus.store

    @property
    def chunk_tokens(self) -> int:
        return self.ingestion.chunk_tokens

    @property
    def batch_size(self) -> int:
        return self.ingestion.batch_size

    @batch_size.setter
    def batch_size(self, n: int) -> None:
        self.ingestion.batch_size = n

    def kv_bytes_per_token(self) -> int:
        return self.corpus.kv_bytes_per_token()

    def system_key(self) -> tuple[str, list[int]]:
        return self.corpus.system_key()

    # ------------------------------------------------------------------ ingestion
    def ensure_system_prefix(self) -> bool:
        return self.ingestion.ensure_system_prefix()

    def check_document(self, doc: Document, doc_id: str) -> tuple[str, str] | None:
        return self.ingestion.check_document(doc, doc_id)

    def ingest(self, docs: Iterable[Document], progress: bool = False, publish: str = "batch",
               before_commit: Callable[[], None] | None = None, strict: bool = False) -> IngestSummary:
        """See `Ingestion.ingest`."""
        return self.ingestion.ingest(docs, progress, publish, before_commit, strict)

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
        c = self.corpus
        counts = c.db.counts()
        per_token = c.kv_bytes_per_token()
        return {
            **counts,
            "incomplete_documents": len(c.db.incomplete()),
            "index": {"kind": c.index.kind, "configured": c.index.params.kind, "vectors": len(c.index),
                      "dim": c.index.dim, "embedder": c.embedder.name},
            "kv": {"format": c.engine.config.kv_format, "bytes_per_token": per_token,
                   "bytes_estimate": c.kv_estimate(counts["passages"], counts["tokens"]), "store": c.store.stats().as_dict()},
            "model": c.engine.runner.name,
            "chunk_tokens": self.chunk_tokens,
        }
