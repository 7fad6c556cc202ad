"""`python -m benchmarks.retrieval`: recall@5 and recall@10 of the supporting passages, dense vs lexical vs
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
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.data import Example, load_examples
from retrieval.embedder import Embedder
from retrieval.index import IndexParams, VectorIndex
from retrieval.lexical import RETRIEVAL_MODES
from retrieval.passages import PassageDB, PassageRow, passage_id, vec_id_of
from retrieval.retriever import Retriever, embed_text

KS = (5, 10)


def build_store(examples: list[Example], db: PassageDB, embedder: Embedder) -> VectorIndex:
    """Every paragraph once (as ingestion keys it), embedded; the index over them."""
    rows: dict[str, PassageRow] = {}
    for ex in examples:
        for p in ex.paragraphs:
            doc_id = f"{ex.dataset}:{p.title}"
            pid = passage_id(doc_id, p.title, p.text)
            rows.setdefault(pid, PassageRow(pid, vec_id_of(pid), doc_id, 0, p.title, p.text, ex.dataset, 0, pid))
    ordered = list(rows.values())
    vecs = embedder.encode([embed_text(r.title, r.text) for r in ordered], progress=True)  # [N, dim]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=("hotpotqa", "musique"), default="hotpotqa",
                    help="musique: the development set for the fusion's settings (--grid), kept apart from hotpotqa")
    ap.add_argument("--n", type=int, default=500, help="questions (the hotpotqa file holds 500, musique 181)")
    ap.add_argument("--grid", action="store_true", help="also hybrid at RRF k in (10, 30, 60) x candidates in "
                                                        "(20, 50, 100)")
    ap.add_argument("--data-dir", type=Path, default=None, help="the shared data (default: benchmarks.data)")
    ap.add_argument("--candidates", type=int, default=50, help="hits per list fused in hybrid (BLENDSERVE_HYBRID_CANDIDATES)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    examples = load_examples(args.dataset, args.n, args.data_dir)
    embedder = Embedder()
    with tempfile.TemporaryDirectory(prefix="bench-retrieval-") as tmp:
        db = PassageDB(Path(tmp) / "passages.sqlite3")
        t0 = time.perf_counter()
        index = build_store(examples, db, embedder)
        print(f"{args.dataset}: {len(examples)} questions, {len(index)} passages stored and embedded in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        retriever = Retriever(QueryMemo(embedder), index, db, placement="score", candidates=args.candidates)
        rows = [recall(examples, retriever, mode) for mode in RETRIEVAL_MODES]
        for rrf_k, depth in ([(k, c) for k in (10, 30, 60) for c in (20, 50, 100)] if args.grid else []):
            retriever.rrf_k, retriever.candidates = rrf_k, depth
            rows.append(recall(examples, retriever, "hybrid", f"hybrid k={rrf_k} candidates={depth}"))
        db.close()
    print("| retrieval | recall@5 | recall@10 | ms / query (dense: the first search embeds the question) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['recall@5']:.3f} | {r['recall@10']:.3f} | {r['ms_per_query']} |")
    if args.out:
        args.out.write_text(json.dumps({"dataset": args.dataset, "questions": len(examples), "passages": len(index),
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
