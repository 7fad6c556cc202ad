"""Ingestion: documents -> passages -> (KV cache, embedding, passage row, index entry).

Each passage is tokenized once: chunking measures candidate texts with the engine's tokenizer
(memoized per document), and the ids of the final passage text key and precompute its KV.

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
cancelled), so a request that fails or times out commits nothing. Cancellation is explicit: the
caller's `should_stop` (`blend_engine.cancel.StopCheck`) is checked between batches and handed to
every precompute, which checks it between layers (or forwards); a cancelled run drops what it
staged and keeps what it published. `pace`, when given, is called before each passage's KV
precompute (a background job steps aside for the requests the engine is serving).

KV precompute: one passage at a time (`precompute_batch` 1, the CPU default: a forward per
passage, cancellation between its layers), or on a device `precompute_batch` passages per
forward (`BlendEngine.precompute_many`: right-padded, each passage alone at 0..T-1), with
cancellation checked between those forwards; at most an ingest batch (`batch_size`) per forward.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from blend_engine.cancel import Cancelled, StopCheck, never, stop_if
from blend_engine.errors import InputError
from corpus_tools.chunking import chunk_text
from corpus_tools.corpus import Corpus
from corpus_tools.documents import Document, resolve_doc_id
from logsafe import has_control, printable
from retrieval.passages import PassageRow, passage_id, vec_id_of
from retrieval.vectors import embed_text, stored_or_embedded

logger = logging.getLogger(__name__)

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
    location: str = ""


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

    def summary(self, seconds: float) -> IngestSummary:
        return IngestSummary(
            documents=self.documents, passages=self.passages, new_passages=self.new, skipped=self.skipped,
            tokens=self.tokens, kv_bytes=self.kv_bytes, seconds=seconds, errors=tuple(self.errors),
            doc_ids=tuple(self.doc_ids), kv_computed=self.kv_computed, kv_seconds=self.kv_s,
            embed_seconds=self.embed_s, index_seconds=self.index_s,
        )


@dataclass
class _Run:
    """One ingest call's unpublished state (documents staged but not yet visible, and their new
    vectors), with the caller's stop check and pace."""

    should_stop: StopCheck = never  # true once the run should stop (checked between batches and layers)
    pace: Callable[[], None] | None = None  # called before each passage's KV precompute
    staged: dict[str, None] = field(default_factory=dict)  # doc ids with rows staged by this run
    complete: list[str] = field(default_factory=list)  # doc ids whose every passage is staged
    vecs: dict[int, np.ndarray] = field(default_factory=dict)  # vec_id -> embedding of a passage new to the index
    published: dict[str, set[str]] = field(default_factory=dict)  # doc id -> passage ids this run made visible


def default_precompute_batch(device_type: str) -> int:
    """Passages per precompute forward when not configured: batched on a device, one at a time on the CPU
    (a CPU forward gains little from batching and loses the per-layer cancellation checks)."""
    return 1 if device_type == "cpu" else 16


class Ingestion:
    """Chunk, precompute, embed, stage and publish documents into a `Corpus`."""

    def __init__(self, corpus: Corpus, chunk_tokens: int = 256, batch_size: int = 32,
                 precompute_batch: int = 1) -> None:
        if precompute_batch < 1:
            raise ValueError("precompute_batch must be >= 1")
        self.corpus = corpus
        self.chunk_tokens = chunk_tokens
        self.batch_size = batch_size
        self.precompute_batch = precompute_batch

    def ensure_system_prefix(self, should_stop: StopCheck = never) -> bool:
        """Precompute the system prefix and the passage markers (`Corpus.fixed_chunks`) so the first
        query misses nothing. True when the system prefix was computed now."""
        (_, sys_ids), *markers = self.corpus.fixed_chunks()
        if markers:  # one forward for all of them: a few tokens each
            self.corpus.engine.cache_many([ids for _, ids in markers], len(markers), should_stop=should_stop)
        return not self.corpus.cache(sys_ids, should_stop)[1]

    def _chunks(self, doc: Document, doc_id: str) -> list[_Candidate]:
        title = doc.title.strip()
        seen: dict[str, list[int]] = {}  # chunking measures a text more than once: tokenize it once

        def tokens_of(text: str) -> list[int]:
            if text not in seen:
                seen[text] = self.corpus.passage_tokens(text, title)
            return seen[text]

        parts = [(s.text, s.location) for s in doc.sections] or [(doc.text, "")]  # a passage stays in its section
        pieces = [(text, ids, where) for body, where in parts for text, ids in chunk_text(body, tokens_of, self.chunk_tokens)]
        return [
            _Candidate(passage_id(doc_id, title, text), doc_id, seq, title, text, doc.source, ids, where)
            for seq, (text, ids, where) in enumerate(pieces)
        ]

    def check_document(self, doc: Document, doc_id: str) -> tuple[str, str] | None:
        """(field, message) when a document cannot be ingested as given, else None.

        Its id must be addressable and safe to log (no control characters); its title, repeated in
        every passage, may take at most half a passage so that the text always fits beside it."""
        if has_control(doc_id):
            return "doc_id", "doc_id must not contain control characters (newline, carriage return, tab, escape, ...)"
        if not doc.text.strip():
            return "text", "empty text"
        title = doc.title.strip()
        if title:
            n = len(self.corpus.passage_tokens("x", title)) - len(self.corpus.engine.passage_tokens("x"))
            if n > self.chunk_tokens // 2:
                return "title", (f"title is {n} tokens; title and text must fit a passage of {self.chunk_tokens} "
                                 f"tokens, so a title may take at most {self.chunk_tokens // 2}")
        return None

    def _check_all(self, docs: list[Document]) -> None:
        """strict mode: the first document that cannot be ingested raises before anything is written."""
        for i, doc in enumerate(docs):
            problem = self.check_document(doc, resolve_doc_id(doc))
            if problem is not None:
                raise DocumentRejected(i, *problem)

    # ------------------------------------------------------------------ ingest
    def ingest(self, docs: Iterable[Document], progress: bool = False, publish: str = "batch",
               before_commit: Callable[[], None] | None = None, strict: bool = False, *,
               should_stop: StopCheck = never, pace: Callable[[], None] | None = None) -> IngestSummary:
        """Chunk, precompute, embed, stage and publish `docs` (see the module docstring).

        strict: a document that fails `check_document` raises DocumentRejected before anything is
        written (the API); otherwise it is skipped and reported in `errors` (the CLI).
        should_stop: raises `Cancelled` at the next batch or layer once true (what was published stays).
        pace: called before each passage's KV precompute; it returns when the run may go on."""
        if publish not in PUBLISH_MODES:
            raise ValueError(f"publish must be one of {PUBLISH_MODES}, not {publish!r}")
        t0 = time.perf_counter()
        if strict:
            docs = list(docs)
            self._check_all(docs)
        tally, run = _Tally(), _Run(should_stop=should_stop, pace=pace)
        bar = tqdm(desc="ingest", unit="passage", file=sys.stderr, disable=not progress, dynamic_ncols=True)
        try:
            self.ensure_system_prefix(should_stop)
            pending = self._stage_documents(docs, tally, run, bar, publish, before_commit, checked=strict)
            if pending:
                self._flush(pending, tally, bar, run)
            stop_if(should_stop, "before publishing")
            self._publish(run, before_commit)
        except Cancelled:
            self._discard(run)
            raise
        finally:
            bar.close()
        return tally.summary(time.perf_counter() - t0)

    def _stage_documents(self, docs: Iterable[Document], tally: _Tally, run: _Run, bar, publish: str,
                         before_commit: Callable[[], None] | None, checked: bool = False) -> list[_Candidate]:
        """Stage full batches as they fill (publishing each with publish="batch"); the rest is returned.
        checked: every document already passed `check_document` (strict mode)."""
        pending: list[_Candidate] = []
        seen: set[str] = set()  # within one run, documents sharing a doc_id add up (HotpotQA repeats paragraphs)
        for doc in docs:
            doc_id = resolve_doc_id(doc)
            tally.documents += 1
            tally.doc_ids[doc_id] = None
            problem = None if checked else self.check_document(doc, doc_id)
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
        return pending

    def _flush(self, batch: list[_Candidate], tally: _Tally, bar, run: _Run) -> None:
        """Precompute and stage one batch (one transaction). Nothing becomes visible here."""
        stop_if(run.should_stop, "between ingestion batches")
        c = self.corpus
        with c.lock:
            existing = c.db.get_many([cand.pid for cand in batch])
            if self.precompute_batch > 1:
                self._precompute_missing(batch, tally, run.should_stop)
            rows = []
            for cand in batch:
                if run.pace is not None:
                    run.pace()  # a background job steps aside for requests here
                rows.append(self._cache_one(cand, existing.get(cand.pid), tally, run.should_stop))
            fresh = [r for r in rows if r.vec_id not in c.index]
            t = time.perf_counter()
            if fresh:
                texts = [embed_text(r.title, r.text) for r in fresh]
                vecs = c.engine.run_compute(lambda: c.embedder.encode(texts), run.should_stop)  # [N, dim]
                run.vecs.update(zip((r.vec_id for r in fresh), vecs))
            tally.embed_s += time.perf_counter() - t
            stop_if(run.should_stop, "before staging a batch")
            t = time.perf_counter()
            c.db.stage(rows, {r.vec_id: run.vecs[r.vec_id] for r in rows if r.vec_id in run.vecs})  # one transaction
            run.staged.update(dict.fromkeys(r.doc_id for r in rows))
            tally.index_s += time.perf_counter() - t
            tally.new += sum(1 for r in rows if r.id not in existing)
        bar.update(len(batch))

    def _precompute_missing(self, batch: list[_Candidate], tally: _Tally, should_stop: StopCheck) -> None:
        """The KV of this batch's passages the store lacks, `precompute_batch` per forward, stored
        before `_cache_one` finds them (and counted here, not there). Cancellation is checked
        between forwards (the model's own forward runs the layers). A put the store skips (full)
        leaves the passage to `_cache_one`, which computes it alone."""
        t = time.perf_counter()
        ids = [cand.token_ids for cand in batch]
        for tokens, stored in zip(ids, self.corpus.engine.cache_many(ids, self.precompute_batch,
                                                                     should_stop=should_stop)):
            if stored:
                tally.kv_computed += 1
                tally.kv_bytes += self.corpus.kv_nbytes(len(tokens))
        tally.kv_s += time.perf_counter() - t

    def _publish(self, run: _Run, before_commit: Callable[[], None] | None) -> None:
        """Make every completed document visible in one transaction, then update the index to match."""
        docs = [d for d in run.complete if d in run.staged]
        if not docs:
            return
        c = self.corpus
        with c.lock:
            if before_commit is not None:
                before_commit()
            removed, published = c.db.publish(docs, {d: run.published.get(d, set()) for d in docs})
            for r in published:
                run.published.setdefault(r.doc_id, set()).add(r.id)
            self._sync_index(removed, published, run)
            c.drop_unused_kv({r.kv_key for r in removed} - {r.kv_key for r in published})
            logger.debug("published %d documents (%d passages, %d replaced)", len(docs), len(published), len(removed))
        for d in docs:
            run.staged.pop(d, None)
        run.complete = [d for d in run.complete if d not in set(docs)]

    def _sync_index(self, removed: list[PassageRow], published: list[PassageRow], run: _Run) -> None:
        index = self.corpus.index
        keep = {r.vec_id for r in published}
        gone = [r.vec_id for r in removed if r.vec_id not in keep]
        if gone:
            index.remove(np.asarray(gone, dtype=np.int64))
        new = [r for r in published if r.vec_id not in index]
        missing = [r.vec_id for r in new if r.vec_id not in run.vecs]
        if missing:  # staged by an earlier run: its stored embedding (else embedded now)
            run.vecs.update(stored_or_embedded(self.corpus.db, self.corpus.embedder, missing))
        if new:
            index.add(np.asarray([r.vec_id for r in new], dtype=np.int64), np.stack([run.vecs[r.vec_id] for r in new]))
        if gone or new:
            self.corpus.save_index()

    def _discard(self, run: _Run) -> None:
        """A cancelled run: drop what it staged (never visible), so nothing of it remains."""
        if not run.staged:
            return
        try:
            self.corpus.db.discard(list(run.staged))
        except Exception:  # noqa: BLE001 - leftovers are invisible and reported by verify
            logger.warning("could not drop the staged rows of a cancelled ingestion", exc_info=True)
        run.staged.clear()

    def _cache_one(self, cand: _Candidate, row: PassageRow | None, tally: _Tally,
                   should_stop: StopCheck) -> PassageRow:
        """Make sure the passage's KV is stored (from the ids chunking produced); the row to stage."""
        tally.passages += 1
        tally.tokens += len(cand.token_ids)
        key = self.corpus.engine.key_of(cand.token_ids)
        if row is not None and row.kv_key == key and self.corpus.store.contains(key):
            tally.skipped += 1
            return PassageRow(**{**row.__dict__, "seq": cand.seq, "location": cand.location})
        t = time.perf_counter()
        key, was_cached = self.corpus.cache(cand.token_ids, should_stop)
        tally.kv_s += time.perf_counter() - t
        if not was_cached:
            tally.kv_computed += 1
            tally.kv_bytes += self.corpus.kv_nbytes(len(cand.token_ids))
        if row is not None and row.kv_key == key:
            tally.skipped += 1  # row present, KV was missing and is now back
            return PassageRow(**{**row.__dict__, "seq": cand.seq, "location": cand.location})
        return PassageRow(id=cand.pid, vec_id=vec_id_of(cand.pid), doc_id=cand.doc_id, seq=cand.seq, title=cand.title,
                          text=cand.text, source=cand.source, token_count=len(cand.token_ids), kv_key=key,
                          location=cand.location)
