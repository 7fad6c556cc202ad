"""Ingestion: documents -> passages -> (KV cache, embedding, SQLite row, index entry).

Crash safety. Per batch: KV entries are written first (content-keyed, so rewriting is harmless),
then the rows (with their embeddings and change-log entries) in one passage-store transaction,
then the index is saved atomically. The passage store (SQLite or PostgreSQL) is the source of
truth; at start-up `open_index` re-adds vectors the index lacks and drops ones no
passage owns, so a run killed at any point resumes without duplicates.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from blend_engine.engine import BlendEngine
from blend_engine.layout import format_passage
from blend_engine.types import BlendPlan
from corpus_tools.chunking import chunk_text
from corpus_tools.documents import Document, resolve_doc_id
from retrieval.embedder import Embedder
from retrieval.index import VectorIndex
from retrieval.passages import PassageRow, PassageStore, passage_id, vec_id_of
from retrieval.retriever import embed_text, reconcile

logger = logging.getLogger(__name__)

KV_WIDTH = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


@dataclass(frozen=True)
class IngestSummary:
    documents: int
    passages: int  # distinct passages in the input
    new_passages: int  # rows added to the passage store
    skipped: int  # already stored with their KV cached
    tokens: int  # tokens of all input passages
    kv_bytes: int  # KV bytes precomputed by this run
    seconds: float
    errors: tuple[str, ...] = ()
    doc_ids: tuple[str, ...] = ()
    kv_computed: int = 0  # passages whose KV this run precomputed
    kv_seconds: float = 0.0
    embed_seconds: float = 0.0
    index_seconds: float = 0.0


@dataclass
class _Candidate:
    pid: str
    doc_id: str
    seq: int
    title: str
    text: str
    source: str
    token_ids: list[int]

    @property
    def passage(self) -> str:
        return format_passage(self.text, self.title)


@dataclass
class _Tally:
    documents: int = 0
    passages: int = 0
    new: int = 0
    skipped: int = 0
    tokens: int = 0
    kv_bytes: int = 0
    kv_computed: int = 0
    kv_s: float = 0.0
    embed_s: float = 0.0
    index_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    doc_ids: dict[str, None] = field(default_factory=dict)


@dataclass(frozen=True)
class VerifyReport:
    passages: int
    kv_ok: int
    problems: tuple[str, ...]
    repaired: int
    index_missing: int
    index_extra: int

    @property
    def ok(self) -> bool:
        return not self.problems or self.repaired >= len(self.problems)


class IngestPipeline:
    """Thread-safe: writes (ingest batches, deletes, verify, gc) are serialized by one lock."""

    def __init__(self, engine: BlendEngine, embedder: Embedder, index: VectorIndex, db: PassageStore,
                 index_dir: Path, chunk_tokens: int = 256, batch_size: int = 32) -> None:
        self.engine = engine
        self.embedder = embedder
        self.index = index
        self.db = db
        self.index_dir = Path(index_dir)
        self.chunk_tokens = chunk_tokens
        self.batch_size = batch_size
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ helpers
    @property
    def store(self):
        return self.engine.store

    def kv_bytes_per_token(self) -> int:
        s = self.engine.runner.shape
        return 2 * s.n_layers * s.n_kv_heads * s.head_dim * KV_WIDTH.get(self.engine.config.kv_format, 2)

    def system_key(self) -> tuple[str, list[int]]:
        """Key and ids of the default system prefix (cached alone at position 0, like a passage)."""
        sys_seg = self.engine.layout(BlendPlan(passages=("x",), question="x")).segments[0]
        return self.engine.key_of(sys_seg.token_ids), list(sys_seg.token_ids)

    def ensure_system_prefix(self) -> bool:
        """Precompute the system prefix so the first query misses nothing. True when computed now."""
        key, ids = self.system_key()
        if self.store.contains(key):
            return False
        return bool(self.store.put(key, self.engine.precompute(ids)))

    def _chunks(self, doc: Document, doc_id: str) -> list[_Candidate]:
        title = doc.title.strip()

        def tokens_of(text: str) -> list[int]:
            return self.engine.passage_tokens(format_passage(text, title))

        return [
            _Candidate(passage_id(doc_id, title, text), doc_id, seq, title, text, doc.source, ids)
            for seq, (text, ids) in enumerate(chunk_text(doc.text, tokens_of, self.chunk_tokens))
        ]

    # ------------------------------------------------------------------ ingest
    def ingest(self, docs: Iterable[Document], progress: bool = False) -> IngestSummary:
        t0 = time.perf_counter()
        tally = _Tally()
        seen: set[str] = set()
        pending: list[_Candidate] = []
        bar = tqdm(desc="ingest", unit="passage", file=sys.stderr, disable=not progress, dynamic_ncols=True)
        try:
            self.ensure_system_prefix()
            for doc in docs:
                doc_id = resolve_doc_id(doc)
                tally.documents += 1
                tally.doc_ids[doc_id] = None
                if not doc.text.strip():
                    tally.errors.append(f"document {doc_id}: empty text")
                    continue
                for cand in self._chunks(doc, doc_id):
                    if cand.pid in seen:
                        continue
                    seen.add(cand.pid)
                    pending.append(cand)
                    if len(pending) >= self.batch_size:
                        self._flush(pending, tally, bar)
                        pending = []
            if pending:
                self._flush(pending, tally, bar)
        finally:
            bar.close()
        return IngestSummary(
            documents=tally.documents, passages=tally.passages, new_passages=tally.new, skipped=tally.skipped,
            tokens=tally.tokens, kv_bytes=tally.kv_bytes, seconds=time.perf_counter() - t0,
            errors=tuple(tally.errors), doc_ids=tuple(tally.doc_ids), kv_computed=tally.kv_computed,
            kv_seconds=tally.kv_s, embed_seconds=tally.embed_s, index_seconds=tally.index_s,
        )

    def _flush(self, batch: list[_Candidate], tally: _Tally, bar) -> None:
        with self._lock:
            existing = self.db.get_many([c.pid for c in batch])
            new_rows: list[PassageRow] = []
            changed: list[PassageRow] = []
            for cand in batch:
                row = self._cache_one(cand, existing.get(cand.pid), tally)
                if row is None:
                    continue
                (changed if cand.pid in existing else new_rows).append(row)
            t = time.perf_counter()
            vecs = self.embedder.encode([embed_text(r.title, r.text) for r in new_rows])  # [N, dim]
            tally.embed_s += time.perf_counter() - t
            t = time.perf_counter()
            inserted: list[str] = []
            if new_rows or changed:  # one transaction; embeddings stored with the rows, `add`s logged
                inserted = self.db.upsert(new_rows + changed, dict(zip((r.vec_id for r in new_rows), vecs)))
            if new_rows:
                self.index.add(np.asarray([r.vec_id for r in new_rows], dtype=np.int64), vecs)
                self.index.save(self.index_dir)
            tally.index_s += time.perf_counter() - t
            tally.new += len(inserted)  # another replica may have inserted some of them first
        bar.update(len(batch))

    def _cache_one(self, cand: _Candidate, row: PassageRow | None, tally: _Tally) -> PassageRow | None:
        """Make sure the passage's KV is stored; the row to write, or None when nothing changes."""
        tally.passages += 1
        tally.tokens += len(cand.token_ids)
        key = self.engine.key_of(cand.token_ids)
        if row is not None and row.kv_key == key and self.store.contains(key):
            tally.skipped += 1
            return None
        t = time.perf_counter()
        key2, n_tokens, was_cached = self.engine.ensure_cached(cand.passage)
        tally.kv_s += time.perf_counter() - t
        if key2 != key or n_tokens != len(cand.token_ids):
            raise RuntimeError(f"passage {cand.pid}: tokenization is not stable ({key} vs {key2})")
        if not was_cached:
            tally.kv_computed += 1
            tally.kv_bytes += n_tokens * self.kv_bytes_per_token()
        if row is not None and row.kv_key == key:
            tally.skipped += 1  # row present, KV was missing and is now back
            return None
        return PassageRow(id=cand.pid, vec_id=vec_id_of(cand.pid), doc_id=cand.doc_id, seq=cand.seq,
                          title=cand.title, text=cand.text, source=cand.source, token_count=n_tokens, kv_key=key)

    # ------------------------------------------------------------------ documents
    def get_document(self, doc_id: str) -> dict | None:
        rows = self.db.document(doc_id)
        if not rows:
            return None
        return {
            "doc_id": doc_id, "title": rows[0].title, "source": rows[0].source,
            "passages": [{"id": r.id, "title": r.title, "text": r.text, "token_count": r.token_count,
                          "kv_key": r.kv_key} for r in rows],
        }

    def delete_document(self, doc_id: str) -> bool:
        """Remove the document's passages (SQLite, then index, then KV entries no one else uses)."""
        with self._lock:
            rows = self.db.delete_document(doc_id)
            if not rows:
                return False
            self.index.remove(np.asarray([r.vec_id for r in rows], dtype=np.int64))
            self.index.save(self.index_dir)
            for key in {r.kv_key for r in rows}:
                if not self.db.key_in_use(key):
                    self.store.delete(key)
            logger.info("deleted document %s (%d passages)", doc_id, len(rows))
            return True

    def stats(self) -> dict:
        counts = self.db.counts()
        store = self.store.stats().as_dict()
        return {
            **counts,
            "index": {"kind": self.index.kind, "configured": self.index.params.kind, "vectors": len(self.index),
                      "dim": self.index.dim, "embedder": self.embedder.name},
            "kv": {"format": self.engine.config.kv_format, "bytes_per_token": self.kv_bytes_per_token(),
                   "bytes_estimate": counts["tokens"] * self.kv_bytes_per_token(), "store": store},
            "model": self.engine.runner.name,
            "chunk_tokens": self.chunk_tokens,
        }

    # ------------------------------------------------------------------ maintenance
    def verify(self, repair: bool = False, progress: bool = False) -> VerifyReport:
        """Check every passage's KV (present, right key, right shape) and the index against SQLite."""
        with self._lock:
            rows = self.db.all_rows()
            problems: list[str] = []
            repaired = kv_ok = 0
            n_layers = self.engine.runner.shape.n_layers
            for row in tqdm(rows, desc="verify", unit="passage", file=sys.stderr, disable=not progress):
                problem = self._check_row(row, n_layers)
                if problem is None:
                    kv_ok += 1
                    continue
                problems.append(f"passage {row.id} (doc {row.doc_id}): {problem}")
                if repair:
                    self._repair_row(row)
                    repaired += 1
            want, have = self.db.vec_ids(), set(self.index.ids().tolist())
            missing, extra = len(want - have), len(have - want)
            if missing or extra:
                problems.append(f"index: {missing} passages missing, {extra} vectors without a passage")
                if repair:
                    reconcile(self.index, self.db, self.embedder)
                    self.index.save(self.index_dir)
                    repaired += 1
            return VerifyReport(len(rows), kv_ok, tuple(problems), repaired, missing, extra)

    def _check_row(self, row: PassageRow, n_layers: int) -> str | None:
        ids = self.engine.passage_tokens(format_passage(row.text, row.title))
        key = self.engine.key_of(ids)
        if key != row.kv_key:
            return f"stored KV key {row.kv_key} is stale (model or tokenizer changed; now {key})"
        if len(ids) != row.token_count:
            return f"token count {row.token_count} != {len(ids)}"
        kv = self.store.get(key)
        if kv is None:
            return "KV cache missing or unreadable"
        if kv.n_tokens != len(ids) or kv.n_layers != n_layers:
            return f"KV cache has shape layers={kv.n_layers} tokens={kv.n_tokens}, want {n_layers}, {len(ids)}"
        if not bool(kv.k.isfinite().all()) or not bool(kv.v.isfinite().all()):
            return "KV cache holds non-finite values"
        return None

    def _repair_row(self, row: PassageRow) -> None:
        passage = format_passage(row.text, row.title)
        key = self.engine.key_of(self.engine.passage_tokens(passage))
        self.store.delete(key)
        key, n_tokens, _ = self.engine.ensure_cached(passage)
        if key != row.kv_key or n_tokens != row.token_count:
            self.db.set_kv(row.id, key, n_tokens)
            if not self.db.key_in_use(row.kv_key):
                self.store.delete(row.kv_key)

    def gc(self) -> dict:
        """Drop KV entries that no passage (nor the system prefix) references, where tiers can list keys."""
        with self._lock:
            keep = self.db.kv_keys() | {self.system_key()[0]}
            listable, unlisted = _listable_tiers(self.store)
            if not listable:
                return {"supported": False, "referenced": len(keep), "dropped": 0, "unlisted_tiers": unlisted,
                        "message": f"store {self.store.name!r} cannot list its keys; nothing dropped"}
            before = self.store.stats().bytes_used
            candidates = {k for tier in listable for k in tier.keys()} - keep
            dropped = sum(1 for key in sorted(candidates) if self.store.delete(key))
            freed = before - self.store.stats().bytes_used
            return {"supported": True, "referenced": len(keep), "dropped": dropped, "freed_bytes": freed,
                    "tiers": [t.name for t in listable], "unlisted_tiers": unlisted}


def _listable_tiers(store) -> tuple[list, list[str]]:
    """(tiers that can list their keys, names of those that cannot). A plain store is its own tier."""
    tiers = list(getattr(store, "tiers", None) or [store])
    listable = [t for t in tiers if callable(getattr(t, "keys", None))]
    return listable, [t.name for t in tiers if t not in listable]
