"""Question -> passages: dense (embed, search the FAISS index), lexical (full-text search in the passage
store) or hybrid (both, fused: `lexical.Fusion`), optionally reranked; fetch rows, order them for the prompt."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrieval.embedder import Embedder
from retrieval.index import IndexParams, VectorIndex
from retrieval.lexical import NO_FILTERS, RETRIEVAL_MODES, TITLE_WEIGHT, Filters, Fusion, convex, fuse, query_terms
from retrieval.passages import PassageRow, PassageStore
from retrieval.sync import IndexSync
from retrieval.text import format_passage
from retrieval.vectors import stored_or_embedded

logger = logging.getLogger(__name__)

PLACEMENTS = ("score", "best_last")
OVERFETCH = 10  # a filtered dense search asks FAISS for this many times the hits, then filters them
EXACT_SCAN_MAX = 100_000  # ... and when too few pass, scores at most this many filtered passages exactly


@dataclass(frozen=True)
class RetrievedPassage:
    id: str
    doc_id: str
    title: str
    text: str
    score: float
    source: str = ""
    location: str = ""  # page or heading path ("" when none)
    seq: int = 0  # the passage's index in its document

    @property
    def passage(self) -> str:
        """The string handed to the engine (same as at ingestion, so its cache key matches)."""
        return format_passage(self.text, self.title)


def place(passages: list[RetrievedPassage], placement: str) -> list[RetrievedPassage]:
    """Prompt order. 'score': best first. 'best_last': best nearest the question (last)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
    ranked = sorted(passages, key=lambda p: (-p.score, p.id))
    return ranked if placement == "score" else ranked[::-1]


class Retriever:
    """`mode` (dense, lexical or hybrid) is the default a request may override; `fusion` says how hybrid
    merges the two lists and how many hits each contributes (`fusion.candidates`, which the reranker also
    sees); `title_weight` is what a title hit counts in the lexical score, a text hit counting 1 (BM25F
    style); `reranker` rescores the fused list."""

    def __init__(self, embedder: Embedder, index: VectorIndex, db: PassageStore, placement: str = "best_last",
                 mode: str = "dense", fusion: Fusion | None = None, title_weight: float = TITLE_WEIGHT, reranker=None) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
        if not title_weight > 0:
            raise ValueError(f"title_weight must be > 0, not {title_weight}")
        self.embedder = embedder
        self.index = index
        self.db = db
        self.placement = placement
        self.mode = check_mode(mode)
        self.fusion = fusion if fusion is not None else Fusion()
        self.title_weight = float(title_weight)
        self.reranker = reranker

    @property
    def candidates(self) -> int:
        return self.fusion.candidates

    def search(self, question: str, k: int, mode: str | None = None,
               filters: Filters = NO_FILTERS) -> list[RetrievedPassage]:
        """Top-k passages (scores: cosine for dense, BM25 / ts_rank for lexical, the fused or reranked score
        for hybrid), filtered by metadata, already in placement order."""
        if not question.strip():
            raise ValueError("question is empty")
        if k <= 0:
            return []
        mode = check_mode(mode or self.mode)
        depth = max(k, self.candidates) if mode == "hybrid" or self.reranker is not None else k
        if mode == "dense":
            ranked = self.dense(question, depth, filters)
        elif mode == "lexical":
            ranked = self.lexical(question, depth, filters)
        else:
            ranked = self.hybrid(question, depth, filters)
        rows = self.db.by_vec_ids([i for i, _ in ranked])
        found = [_to_result(rows[i], s) for i, s in ranked if i in rows]
        if len(found) < len(ranked):
            logger.warning("%d index entries have no passage row; run `corpus_tools verify --repair`",
                           len(ranked) - len(found))
        if self.reranker is not None:
            found = self.reranker.rerank(question, found)
        return place(found[:k], self.placement)

    def lexical(self, question: str, k: int, filters: Filters = NO_FILTERS) -> list[tuple[int, float]]:
        """(vec_id, lexical score) of the k best full-text matches that pass the filters, best first."""
        return self.db.lexical_search(query_terms(question), k, filters, title_weight=self.title_weight)

    def hybrid(self, question: str, k: int, filters: Filters = NO_FILTERS) -> list[tuple[int, float]]:
        """(vec_id, fused score): the dense and the lexical top `k`, fused by `self.fusion`, best first."""
        q = self.embedder.encode([question])  # [1, dim]
        dense = self.dense_by_vector(q, k, filters)
        terms = query_terms(question)
        lexical = self.db.lexical_search(terms, k, filters, title_weight=self.title_weight)
        w = self.fusion.dense_weight
        if self.fusion.method == "rrf":
            return fuse([[i for i, _ in dense], [i for i, _ in lexical]], self.fusion.rrf_k, (w, 1.0 - w))[:k]
        dense_scores, lexical_scores = dict(dense), dict(lexical)  # every candidate scored by both sides:
        lexical_only = [i for i in lexical_scores if i not in dense_scores]
        if lexical_only:
            floor = min(dense_scores.values(), default=0.0)  # a row without a stored embedding: the lowest seen
            for i, vec in self.db.vectors(lexical_only).items():
                dense_scores[i] = float(vec @ q[0]) if vec is not None and vec.shape == q[0].shape else floor
        dense_only = [i for i in dense_scores if i not in lexical_scores]
        if dense_only:
            lexical_scores.update(self.db.lexical_scores(terms, dense_only, title_weight=self.title_weight))
        return convex(dense_scores, lexical_scores, w)[:k]

    def dense(self, question: str, k: int, filters: Filters = NO_FILTERS) -> list[tuple[int, float]]:
        """(vec_id, cosine) of the k nearest passages that pass the filters, best first."""
        return self.dense_by_vector(self.embedder.encode([question]), k, filters)  # [1, dim]

    def dense_by_vector(self, q: np.ndarray, k: int, filters: Filters = NO_FILTERS) -> list[tuple[int, float]]:
        """`dense` for an embedded question `q` [1, dim]."""
        if filters.empty:
            return _hits(*self.index.search(q, k))
        depth = min(k * OVERFETCH, max(len(self.index), 1))
        hits = _hits(*self.index.search(q, depth))
        keep = self.db.matching([i for i, _ in hits], filters)
        hits = [(i, s) for i, s in hits if i in keep]
        if len(hits) >= k or depth >= len(self.index):  # enough, or every passage was looked at
            return hits[:k]
        vectors = self.db.filtered_vectors(filters, EXACT_SCAN_MAX)  # too few passed: score the filtered set
        if not vectors:
            return []
        ids = np.fromiter(vectors, dtype=np.int64, count=len(vectors))  # [N]
        scores = np.stack(list(vectors.values())) @ q[0]  # [N]
        order = np.argsort(-scores, kind="stable")[:k]
        return [(int(ids[j]), float(scores[j])) for j in order]


def check_mode(mode: str) -> str:
    if mode not in RETRIEVAL_MODES:
        raise ValueError(f"retrieval must be one of {RETRIEVAL_MODES}, not {mode!r}")
    return mode


def _hits(scores: np.ndarray, ids: np.ndarray) -> list[tuple[int, float]]:
    """FAISS's [1, k] scores and ids as (vec_id, score), best first, empty slots (-1) dropped."""
    return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]


def _to_result(row: PassageRow, score: float) -> RetrievedPassage:
    return RetrievedPassage(id=row.id, doc_id=row.doc_id, title=row.title, text=row.text, score=score,
                            source=row.source, location=row.location, seq=row.seq)


def open_index(folder: Path, db: PassageStore, embedder: Embedder, params: IndexParams,
               batch_size: int = 256) -> tuple[VectorIndex, dict]:
    """Load the persisted index, catch up from the passage store's change log, and reconcile.

    A persisted index that knows its generation (the last change it holds) first applies the
    change log after it. Then, as a safety net (and the only way for an index without a
    generation), vectors of passages the index lacks are added (the stored embedding, else
    embedded now and stored) and vectors no passage owns are removed. Returns (index, {"loaded",
    "caught_up", "added", "removed", "generation"}), generation being the store's change-log head
    read before reconciling (an `IndexSync` starts from it); saves the index when it changed.
    """
    index = VectorIndex.load(folder, embedder.dim, params, embedder.name)
    loaded = index is not None
    caught_up = 0
    if index is not None and index.generation is not None:
        caught_up = IndexSync(index, db, embedder, index.generation).step()
    elif index is None:
        index = VectorIndex(embedder.dim, params, embedder.name)
    generation = db.head().seq
    added, removed = reconcile(index, db, embedder, batch_size)
    index.generation = generation
    if caught_up or added or removed or not loaded:
        index.save(folder)
    if caught_up or added or removed:
        logger.info("index caught up with the passage store: %d changes from its log, then reconciled +%d -%d",
                    caught_up, added, removed)
    return index, {"loaded": loaded, "caught_up": caught_up, "added": added, "removed": removed,
                   "generation": generation}


def reconcile(index: VectorIndex, db: PassageStore, embedder: Embedder, batch_size: int = 256) -> tuple[int, int]:
    """Make the index hold exactly the passages in the store. Returns (added, removed)."""
    want = db.vec_ids()
    have = set(index.ids().tolist())
    extra = np.asarray(sorted(have - want), dtype=np.int64)
    removed = index.remove(extra) if len(extra) else 0
    missing = sorted(want - have)
    added = 0
    for start in range(0, len(missing), batch_size):
        vectors = stored_or_embedded(db, embedder, missing[start:start + batch_size])
        if vectors:
            ids = np.fromiter(vectors, dtype=np.int64, count=len(vectors))  # [N]
            added += index.add(ids, np.stack(list(vectors.values())))  # [N, dim]
    return added, removed
