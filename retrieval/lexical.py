"""What hybrid retrieval shares across backends: metadata filters (one SQL predicate for SQLite and
PostgreSQL), the words a question is searched by, and the fusion of the dense and lexical lists
(reciprocal rank fusion, optionally weighted per list, or a convex combination of normalised scores).

The lexical search itself runs inside the passage store (SQLite FTS5 with BM25, PostgreSQL
full-text search with ts_rank; `PassageStore.lexical_search`), so there is no second index to keep
in sync and replicas sharing a store agree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

RetrievalMode = Literal["dense", "lexical", "hybrid"]
RETRIEVAL_MODES: tuple[str, ...] = ("dense", "lexical", "hybrid")
RRF_K = 60  # reciprocal rank fusion's constant (Cormack, Clarke and Buettcher, 2009)
FUSIONS: tuple[str, ...] = ("rrf", "convex")
# The defaults (BLENDSERVE_RETRIEVAL_HYBRID_*, BLENDSERVE_RETRIEVAL_LEXICAL_TITLE_WEIGHT), chosen on MuSiQue dev, never on the
# HotpotQA questions the results report (docs/results.md, "Retrieval recall").
FUSION = "convex"
DENSE_WEIGHT = 0.7
CANDIDATES = 50
TITLE_WEIGHT = 5.0
MAX_TERMS = 64  # words of a question searched at most (a pasted page does not become a 5000-term OR)

# Function words left out of the lexical query: they match most passages and rank none (PostgreSQL's
# 'english' configuration drops its own list; FTS5 has none, so the query leaves them out for both).
STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below between both
but by can could did do does doing down during each few for from further had has have having he her here hers
herself him himself his how i if in into is it its itself just me more most my myself no nor not now of off on
once only or other our ours ourselves out over own same she should so some such than that the their theirs
them themselves then there these they this those through to too under until up very was we were what when
where which while who whom why will with would you your yours yourself yourselves
""".split())

_WORD = re.compile(r"[^\W_]+")  # letters and digits of any script; punctuation and underscores split words


@dataclass(frozen=True)
class Filters:
    """Metadata filters, the same on every backend and for every retrieval mode. Times are seconds since
    the epoch (`ingested_at`): `ingested_after` inclusive, `ingested_before` exclusive."""

    source: str | None = None
    doc_id_prefix: str | None = None
    ingested_after: float | None = None
    ingested_before: float | None = None

    @property
    def empty(self) -> bool:
        return all(v is None for v in (self.source, self.doc_id_prefix, self.ingested_after, self.ingested_before))

    def sql(self, alias: str = "p") -> tuple[str, tuple]:
        """A WHERE predicate on `passages AS alias` with `?` placeholders, and its arguments."""
        clauses: list[str] = []
        args: list = []
        if self.source is not None:
            clauses.append(f"{alias}.source = ?")
            args.append(self.source)
        if self.doc_id_prefix:  # substr, not LIKE: no wildcard in a prefix to escape, same in both dialects
            clauses.append(f"substr({alias}.doc_id, 1, ?) = ?")
            args += [len(self.doc_id_prefix), self.doc_id_prefix]
        if self.ingested_after is not None:
            clauses.append(f"{alias}.ingested_at >= ?")
            args.append(float(self.ingested_after))
        if self.ingested_before is not None:
            clauses.append(f"{alias}.ingested_at < ?")
            args.append(float(self.ingested_before))
        return (" AND ".join(clauses) or "1 = 1"), tuple(args)


NO_FILTERS = Filters()


def query_terms(question: str) -> list[str]:
    """The distinct lower-case words of a question, stopwords left out, in order (at most MAX_TERMS)."""
    words = [w for w in _WORD.findall(question.lower()) if w not in STOPWORDS]
    return list(dict.fromkeys(words))[:MAX_TERMS]


@dataclass(frozen=True)
class Fusion:
    """How hybrid retrieval merges the dense and the lexical list.

    `method` "rrf": reciprocal rank fusion, each list's term weighted (`dense_weight` for the dense list,
    1 - `dense_weight` for the lexical one; 0.5 ranks as plain RRF). "convex": `dense_weight` * dense +
    (1 - `dense_weight`) * lexical on the candidates' min-max normalised scores (Bruch, Gai and Ingber,
    2022), every candidate scored by both sides. `candidates`: hits each list contributes.
    """

    method: str = FUSION
    dense_weight: float = DENSE_WEIGHT
    rrf_k: int = RRF_K
    candidates: int = CANDIDATES

    def __post_init__(self) -> None:
        if self.method not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, not {self.method!r}")
        if not 0.0 <= self.dense_weight <= 1.0:
            raise ValueError(f"dense_weight must be within [0, 1], not {self.dense_weight}")
        if self.rrf_k < 0:
            raise ValueError(f"rrf_k must be >= 0, not {self.rrf_k}")
        if self.candidates < 1:
            raise ValueError(f"candidates must be >= 1, not {self.candidates}")


def fuse(rankings: Sequence[Sequence[int]], k: int = RRF_K,
         weights: Sequence[float] | None = None) -> list[tuple[int, float]]:
    """Reciprocal rank fusion: each id scores sum(w / (k + rank)) over the rankings it appears in (rank
    from 1, w the ranking's weight, 1 when `weights` is None); best first, ties by id."""
    if weights is not None and len(weights) != len(rankings):
        raise ValueError(f"{len(weights)} weights for {len(rankings)} rankings")
    scores: dict[int, float] = {}
    for ranking, weight in zip(rankings, weights if weights is not None else [1.0] * len(rankings)):
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + weight / (k + rank)
    return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))


def min_max(scores: dict[int, float]) -> dict[int, float]:
    """Scores rescaled to [0, 1] over the given ids (all 1.0 when they are equal)."""
    if not scores:
        return {}
    low, high = min(scores.values()), max(scores.values())
    if high <= low:
        return dict.fromkeys(scores, 1.0)
    return {i: (s - low) / (high - low) for i, s in scores.items()}


def convex(dense: dict[int, float], lexical: dict[int, float], dense_weight: float) -> list[tuple[int, float]]:
    """Convex combination of min-max normalised scores over the union of the ids: `dense_weight` * dense +
    (1 - `dense_weight`) * lexical; an id missing from one side gets that side's lowest normalised
    score, 0 (callers score every candidate on both sides first). Best first, ties by id."""
    d, lx = min_max(dense), min_max(lexical)
    fused = {i: dense_weight * d.get(i, 0.0) + (1.0 - dense_weight) * lx.get(i, 0.0) for i in {*d, *lx}}
    return sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))
