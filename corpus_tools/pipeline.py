"""Ingestion: documents -> passages -> (KV cache, embedding, SQLite row, index entry).

Crash safety. Per batch: KV entries are written first (content-keyed, so rewriting is harmless),
then the rows (with their embeddings) are *staged* in one passage-store transaction (invisible to retrieval and to
`get_document`). A document becomes visible whole: once all its passages are staged, `publish`
moves them into the passage table in one transaction, removing the passages of its previous
version (re-ingesting a doc_id replaces the document), and only then does the FAISS index gain
their vectors (and lose the replaced ones); the change log records the publish like any write. The
passage store (SQLite or PostgreSQL) is the source of truth; at start-up
`open_index` re-adds vectors the index lacks and drops ones no passage owns, so a run killed at
any point resumes without duplicates. Staged rows left by a kill mark the document incomplete:
`verify` names it; re-running the ingestion completes it.

Publishing: `publish="batch"` (CLI, sample corpus) publishes the documents completed by each
batch, so a long run keeps its progress; `publish="request"` (the HTTP API) publishes every
document at the end in one transaction, after `before_commit()` (the request's last chance to be
cancelled), so a request that fails or times out commits nothing. Cancellation
(`blend_engine.cancel`) is checked between batches and between the layers of every precompute;
a cancelled run drops what it staged.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from blend_engine.cancel import Cancelled, checkpoint
from blend_engine.engine import BlendEngine
from blend_engine.errors import InputError
from blend_engine.types import BlendPlan
from blendserve_config.logsafe import printable
from corpus_tools.chunking import chunk_text
from corpus_tools.documents import Document, resolve_doc_id
from retrieval.embedder import Embedder
from retrieval.index import VectorIndex
from retrieval.passages import PassageRow, PassageStore, passage_id, vec_id_of
from retrieval.retriever import embed_text, reconcile, stored_or_embedded
from retrieval.text import format_passage

logger = logging.getLogger(__name__)

KV_WIDTH = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
PUBLISH_MODES = ("batch", "request")


class DocumentRejected(InputError):
    """A document that cannot be ingested as given: `index` in the input, `field` at fault."""

    def __init__(self, index: int, field: str, message: str) -> None:
        super().__init__(message)
        self.index = index
        self.field = field
        self.message = message


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


@dataclass
class _Run:
    """One ingest call's unpublished state: documents staged but not yet visible, and their new vectors."""

    staged: dict[str, None] = field(default_factory=dict)  # doc ids with rows staged by this run
    complete: list[str] = field(default_factory=list)  # doc ids whose every passage is staged
    vecs: dict[int, np.ndarray] = field(default_factory=dict)  # vec_id -> embedding of a passage new to the index
    published: dict[str, set[str]] = field(default_factory=dict)  # doc id -> passage ids this run made visible


@dataclass(frozen=True)
class VerifyReport:
    passages: int
    kv_ok: int
    problems: tuple[str, ...]
    repaired: int
    index_missing: int
    index_extra: int
    incomplete: tuple[str, ...] = ()  # documents whose ingestion did not finish (staged, not visible)

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

    def check_document(self, doc: Document, doc_id: str) -> tuple[str, str] | None:
        """(field, message) when a document cannot be ingested as given, else None.

        Its id must be addressable and safe to log (no control characters); its title, repeated in
        every passage, may take at most half a passage so that the text always fits beside it."""
        if any(ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F or ch in "\u2028\u2029" for ch in doc_id):
            return "doc_id", "doc_id must not contain control characters (newline, carriage return, tab, escape, ...)"
        if not doc.text.strip():
            return "text", "empty text"
        title = doc.title.strip()
        if title:
            n = len(self.engine.passage_tokens(format_passage("x", title))) - len(self.engine.passage_tokens("x"))
            if n > self.chunk_tokens // 2:
                return "title", (f"title is {n} tokens; title and text must fit a passage of {self.chunk_tokens} "
                                 f"tokens, so a title may take at most {self.chunk_tokens // 2}")
        return None

    # ------------------------------------------------------------------ ingest
    def ingest(self, docs: Iterable[Document], progress: bool = False, publish: str = "batch",
               before_commit: Callable[[], None] | None = None, strict: bool = False) -> IngestSummary:
        """Chunk, precompute, embed, stage and publish `docs` (see the module docstring).

        strict: a document that fails `check_document` raises DocumentRejected before anything is
        written (the API); otherwise it is skipped and reported in `errors` (the CLI)."""
        if publish not in PUBLISH_MODES:
            raise ValueError(f"publish must be one of {PUBLISH_MODES}, not {publish!r}")
        t0 = time.perf_counter()
        tally = _Tally()
        run = _Run()
        pending: list[_Candidate] = []
        seen: set[str] = set()  # within one run, documents sharing a doc_id add up (HotpotQA repeats paragraphs)
        if strict:
            docs = list(docs)
            for i, doc in enumerate(docs):
                problem = self.check_document(doc, resolve_doc_id(doc))
                if problem is not None:
                    raise DocumentRejected(i, *problem)
        bar = tqdm(desc="ingest", unit="passage", file=sys.stderr, disable=not progress, dynamic_ncols=True)
        try:
            self.ensure_system_prefix()
            for doc in docs:
                doc_id = resolve_doc_id(doc)
                tally.documents += 1
                tally.doc_ids[doc_id] = None
                problem = self.check_document(doc, doc_id)
                if problem is not None:
                    tally.errors.append(f"document {printable(doc_id)}: {problem[1]}")
                    continue
                for cand in self._chunks(doc, doc_id):
                    if cand.pid in seen:
                        continue
                    seen.add(cand.pid)
                    pending.append(cand)
                    if len(pending) >= self.batch_size:
                        self._flush(pending, tally, bar, run)
                        pending = []
                        if publish == "batch":
                            self._publish(run, before_commit)
                run.complete.append(doc_id)
            if pending:
                self._flush(pending, tally, bar, run)
            checkpoint("before publishing")
            self._publish(run, before_commit)
        except Cancelled:
            self._discard(run)
            raise
        finally:
            bar.close()
        return IngestSummary(
            documents=tally.documents, passages=tally.passages, new_passages=tally.new, skipped=tally.skipped,
            tokens=tally.tokens, kv_bytes=tally.kv_bytes, seconds=time.perf_counter() - t0,
            errors=tuple(tally.errors), doc_ids=tuple(tally.doc_ids), kv_computed=tally.kv_computed,
            kv_seconds=tally.kv_s, embed_seconds=tally.embed_s, index_seconds=tally.index_s,
        )

    def _flush(self, batch: list[_Candidate], tally: _Tally, bar, run: _Run) -> None:
        """Precompute and stage one batch (one transaction). Nothing becomes visible here."""
        checkpoint("between ingestion batches")
        with self._lock:
            existing = self.db.get_many([c.pid for c in batch])
            rows = [self._cache_one(cand, existing.get(cand.pid), tally) for cand in batch]
            fresh = [r for r in rows if r.vec_id not in self.index]
            t = time.perf_counter()
            if fresh:
                vecs = self.embedder.encode([embed_text(r.title, r.text) for r in fresh])  # [N, dim]
                run.vecs.update(zip((r.vec_id for r in fresh), vecs))
            tally.embed_s += time.perf_counter() - t
            checkpoint("before staging a batch")
            t = time.perf_counter()
            self.db.stage(rows, {r.vec_id: run.vecs[r.vec_id] for r in rows if r.vec_id in run.vecs})  # one transaction
            run.staged.update(dict.fromkeys(r.doc_id for r in rows))
            tally.index_s += time.perf_counter() - t
            tally.new += sum(1 for r in rows if r.id not in existing)
        bar.update(len(batch))

    def _publish(self, run: _Run, before_commit: Callable[[], None] | None) -> None:
        """Make every completed document visible in one transaction, then update the index to match."""
        docs = [d for d in run.complete if d in run.staged]
        if not docs:
            return
        with self._lock:
            if before_commit is not None:
                before_commit()
            removed, published = self.db.publish(docs, {d: run.published.get(d, set()) for d in docs})
            for r in published:
                run.published.setdefault(r.doc_id, set()).add(r.id)
            self._sync_index(removed, published, run)
            for key in {r.kv_key for r in removed} - {r.kv_key for r in published}:
                if not self.db.key_in_use(key):
                    self.store.delete(key)
            logger.debug("published %d documents (%d passages, %d replaced)", len(docs), len(published), len(removed))
        for d in docs:
            run.staged.pop(d, None)
        run.complete = [d for d in run.complete if d not in set(docs)]

    def _sync_index(self, removed: list[PassageRow], published: list[PassageRow], run: _Run) -> None:
        keep = {r.vec_id for r in published}
        gone = [r.vec_id for r in removed if r.vec_id not in keep]
        if gone:
            self.index.remove(np.asarray(gone, dtype=np.int64))
        new = [r for r in published if r.vec_id not in self.index]
        missing = [r.vec_id for r in new if r.vec_id not in run.vecs]
        if missing:  # staged by an earlier run: its stored embedding (else embedded now)
            run.vecs.update(stored_or_embedded(self.db, self.embedder, missing))
        if new:
            self.index.add(np.asarray([r.vec_id for r in new], dtype=np.int64),
                           np.stack([run.vecs[r.vec_id] for r in new]))
        if gone or new:
            self.index.save(self.index_dir)

    def _discard(self, run: _Run) -> None:
        """A cancelled run: drop what it staged (never visible), so nothing of it remains."""
        if not run.staged:
            return
        try:
            self.db.discard(list(run.staged))
        except Exception:  # noqa: BLE001 - leftovers are invisible and reported by verify
            logger.warning("could not drop the staged rows of a cancelled ingestion", exc_info=True)
        run.staged.clear()

    def _cache_one(self, cand: _Candidate, row: PassageRow | None, tally: _Tally) -> PassageRow:
        """Make sure the passage's KV is stored; the row to stage."""
        tally.passages += 1
        tally.tokens += len(cand.token_ids)
        key = self.engine.key_of(cand.token_ids)
        if row is not None and row.kv_key == key and self.store.contains(key):
            tally.skipped += 1
            return PassageRow(**{**row.__dict__, "seq": cand.seq})
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
            return PassageRow(**{**row.__dict__, "seq": cand.seq})
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
            "incomplete_documents": len(self.db.incomplete()),
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
            incomplete = self.db.incomplete()
            for doc_id, n in incomplete.items():
                problems.append(f"document {printable(doc_id)}: incomplete ingestion ({n} passages staged, not visible); "
                                "re-run its ingestion to complete it" + ("; dropped" if repair else ""))
            if repair and incomplete:
                self.db.discard(list(incomplete))
                repaired += len(incomplete)
            want, have = self.db.vec_ids(), set(self.index.ids().tolist())
            missing, extra = len(want - have), len(have - want)
            if missing or extra:
                problems.append(f"index: {missing} passages missing, {extra} vectors without a passage")
                if repair:
                    reconcile(self.index, self.db, self.embedder)
                    self.index.save(self.index_dir)
                    repaired += 1
            return VerifyReport(len(rows), kv_ok, tuple(problems), repaired, missing, extra, tuple(incomplete))

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
