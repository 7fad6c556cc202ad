"""`python -m benchmarks.recall.retrieval`: recall@5 and recall@10 of the supporting passages, dense vs lexical vs
hybrid, on HotpotQA dev (the shared data).

The corpus is every paragraph of the questions read (each question's 2 supporting paragraphs and 8
distractors, pooled: 500 questions give ~4,900 distinct passages), stored as the ingestion stores them
(one passage per paragraph, doc_id `hotpotqa:<title>`, its title line embedded with its text) in a
temporary SQLite passage store with a flat FAISS index. Each question is searched over the whole pool
by the service's `Retriever` in each mode; recall@k is the share of its supporting paragraphs among the
first k, averaged over questions. No KV is computed (retrieval only), so no model is loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.common.data import Example, load_examples
from retrieval import lexical
from retrieval.embedder import Embedder
from retrieval.index import IndexParams, VectorIndex
from retrieval.lexical import FUSIONS, RETRIEVAL_MODES, RRF_K, Fusion
from retrieval.passages import PassageDB, PassageRow, passage_id, vec_id_of
from retrieval.retriever import Retriever
from retrieval.vectors import embed_text

KS = (5, 10)
CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache" / "retrieval-embeddings"  # git-ignored


def cached_encode(embedder: Embedder, texts: list[str], cache_dir: Path | None = CACHE_DIR) -> np.ndarray:
    """The passages' embeddings [N, dim], read from `cache_dir` when this embedder already embedded exactly
    these texts (keyed by the embedder's name and a hash of the texts), else embedded now and saved there."""
    if cache_dir is None:
        return embedder.encode(texts, progress=True)
    digest = hashlib.sha256(embedder.name.encode())
    for t in texts:
        digest.update(hashlib.sha256(t.encode()).digest())
    path = cache_dir / f"{digest.hexdigest()[:32]}.npy"
    if path.exists():
        vecs = np.load(path)
        if vecs.shape == (len(texts), embedder.dim):
            return vecs  # [N, dim]
    vecs = embedder.encode(texts, progress=True)  # [N, dim]
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, vecs)
    tmp.replace(path)
    return vecs


def build_store(examples: list[Example], db: PassageDB, embedder: Embedder,
                cache_dir: Path | None = CACHE_DIR) -> VectorIndex:
    """Every paragraph once (as ingestion keys it), embedded (or read from the cache); the index over them."""
    rows: dict[str, PassageRow] = {}
    for ex in examples:
        for p in ex.paragraphs:
            doc_id = f"{ex.dataset}:{p.title}"
            pid = passage_id(doc_id, p.title, p.text)
            rows.setdefault(pid, PassageRow(pid, vec_id_of(pid), doc_id, 0, p.title, p.text, ex.dataset, 0, pid))
    ordered = list(rows.values())
    vecs = cached_encode(embedder, [embed_text(r.title, r.text) for r in ordered], cache_dir)  # [N, dim]
    db.upsert(ordered, dict(zip((r.vec_id for r in ordered), vecs)))
    index = VectorIndex(embedder.dim, IndexParams(), embedder.name)
    index.add(np.fromiter((r.vec_id for r in ordered), dtype=np.int64, count=len(ordered)), vecs)
    return index


class QueryMemo:
    """The embedder with each question embedded once (the modes and the grid search the same questions)."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder, self.dim, self.name = embedder, embedder.dim, embedder.name
        self.memo: dict[str, np.ndarray] = {}

    def encode(self, texts: list[str]) -> np.ndarray:
        if len(texts) != 1:
            return self.embedder.encode(texts)
        if texts[0] not in self.memo:
            self.memo[texts[0]] = self.embedder.encode(texts)  # [1, dim]
        return self.memo[texts[0]]


def gold_ids(ex: Example) -> set[str]:
    return {passage_id(f"{ex.dataset}:{p.title}", p.title, p.text) for p in ex.paragraphs if p.supporting}


def recall(examples: list[Example], retriever: Retriever, mode: str, label: str | None = None) -> dict:
    hits = {k: 0.0 for k in KS}
    t0 = time.perf_counter()
    for ex in examples:
        gold = gold_ids(ex)
        found = [p.id for p in retriever.search(ex.question, max(KS), mode=mode)]  # placement "score": best first
        for k in KS:
            hits[k] += len(gold & set(found[:k])) / len(gold)
    ms = (time.perf_counter() - t0) * 1e3 / max(len(examples), 1)
    recalls = {f"recall@{k}": round(hits[k] / len(examples), 4) for k in KS}
    return {"mode": label or mode, **recalls, "ms_per_query": round(ms, 1)}


def grid() -> list[tuple[str, str, Fusion, float]]:
    """(label, mode, fusion, title weight) of every configuration the development grid measures: the
    lexical title weight; RRF's k, per-list weight and candidates; the convex combination's weight and
    candidates; then each fusion with the title weight."""
    out = [(f"lexical title_weight={t}", "lexical", Fusion(), t) for t in (1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0)]
    out += [(f"hybrid rrf k={k} dense_weight={w} candidates={c}", "hybrid", Fusion("rrf", w, k, c), 1.0)
            for k in (10, 30, 60) for w in (0.3, 0.4, 0.5, 0.6, 0.7) for c in (20, 50, 100)]
    out += [(f"hybrid convex dense_weight={w} candidates={c}", "hybrid", Fusion("convex", w, RRF_K, c), 1.0)
            for w in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9) for c in (20, 50, 100)]
    out += [(f"hybrid rrf k={k} dense_weight={w} candidates=50 title_weight={t}", "hybrid", Fusion("rrf", w, k, 50), t)
            for k, w in ((60, 0.5), (10, 0.6)) for t in (2.0, 3.0, 5.0, 10.0)]
    out += [(f"hybrid convex dense_weight={w} candidates=50 title_weight={t}", "hybrid", Fusion("convex", w, RRF_K, 50),
             t) for w in (0.5, 0.6, 0.7, 0.8, 0.9) for t in (2.0, 3.0, 5.0, 10.0)]
    return out


def embed_questions(embedder: Embedder, examples: list[Example], cache_dir: Path | None) -> QueryMemo:
    """The embedder with every question embedded up front, in batches (and cached as the passages are)."""
    memo = QueryMemo(embedder)
    questions = list(dict.fromkeys(ex.question for ex in examples))
    memo.memo.update((q, v[None, :]) for q, v in zip(questions, cached_encode(embedder, questions, cache_dir)))
    return memo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=("hotpotqa", "musique"), default="hotpotqa",
                    help="musique: the development set for the fusion's settings (--grid), kept apart from hotpotqa")
    ap.add_argument("--n", type=int, default=500, help="questions (the hotpotqa file holds 500, musique 181)")
    ap.add_argument("--grid", action="store_true", help="also the development grid (`grid`): title weights, RRF k x "
                                                        "weight x candidates, convex weight x candidates")
    ap.add_argument("--data-dir", type=Path, default=None, help="the shared data (default: benchmarks.common.data)")
    ap.add_argument("--fusion", choices=FUSIONS, default=lexical.FUSION,
                    help="hybrid's fusion (BLENDSERVE_RETRIEVAL_HYBRID_FUSION)")
    ap.add_argument("--dense-weight", type=float, default=lexical.DENSE_WEIGHT,
                    help="the dense list's weight in the fusion (BLENDSERVE_RETRIEVAL_HYBRID_DENSE_WEIGHT)")
    ap.add_argument("--rrf-k", type=int, default=RRF_K, help="RRF's k (BLENDSERVE_RETRIEVAL_HYBRID_RRF_K)")
    ap.add_argument("--candidates", type=int, default=lexical.CANDIDATES,
                    help="hits per list fused in hybrid (BLENDSERVE_RETRIEVAL_HYBRID_CANDIDATES)")
    ap.add_argument("--title-weight", type=float, default=lexical.TITLE_WEIGHT,
                    help="a title hit's weight in the lexical score (BLENDSERVE_RETRIEVAL_LEXICAL_TITLE_WEIGHT)")
    ap.add_argument("--no-cache", action="store_true", help=f"embed the passages again, not from {CACHE_DIR}")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    fusion = Fusion(args.fusion, args.dense_weight, args.rrf_k, args.candidates)
    examples = load_examples(args.dataset, args.n, args.data_dir)
    embedder = Embedder()
    with tempfile.TemporaryDirectory(prefix="bench-retrieval-") as tmp:
        db = PassageDB(Path(tmp) / "passages.sqlite3")
        t0 = time.perf_counter()
        cache = None if args.no_cache else CACHE_DIR
        index = build_store(examples, db, embedder, cache)
        print(f"{args.dataset}: {len(examples)} questions, {len(index)} passages stored and embedded in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        retriever = Retriever(embed_questions(embedder, examples, cache), index, db, placement="score", fusion=fusion,
                              title_weight=args.title_weight)
        rows = [recall(examples, retriever, mode) for mode in RETRIEVAL_MODES]
        shipped = (retriever.fusion, retriever.title_weight)
        for label, mode, variant, title_weight in (grid() if args.grid else []):
            retriever.fusion, retriever.title_weight = variant, title_weight
            rows.append(recall(examples, retriever, mode, label))
        retriever.fusion, retriever.title_weight = shipped
        db.close()
    print("| retrieval | recall@5 | recall@10 | ms / query (dense: the first search embeds the question) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['recall@5']:.3f} | {r['recall@10']:.3f} | {r['ms_per_query']} |")
    if args.out:
        args.out.write_text(json.dumps({"dataset": args.dataset, "questions": len(examples), "passages": len(index),
                                        "fusion": asdict(fusion), "title_weight": args.title_weight,
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
