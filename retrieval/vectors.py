"""A passage's embedding: what is embedded for it, and the stored vectors of passages (embedding
and storing the ones that lack one). Shared by the retriever's reconciliation, the index's sync
from the change log and ingestion; imports neither of them (no circle)."""

from __future__ import annotations

import numpy as np

from retrieval.embedder import Embedder
from retrieval.passages import PassageStore
from retrieval.text import format_passage


def embed_text(row_title: str, row_text: str) -> str:
    """What is embedded for a passage: its title line and its text, as the engine sees it."""
    return format_passage(row_text, row_title)


def stored_or_embedded(db: PassageStore, embedder: Embedder, vec_ids: list[int]) -> dict[int, np.ndarray]:
    """Embeddings of the present passages among `vec_ids`: stored ones, the others embedded now and
    stored (rows from before embeddings were kept, or from another embedder's dimension)."""
    stored = db.vectors(vec_ids)
    out = {k: v for k, v in stored.items() if v is not None and v.shape == (embedder.dim,)}
    lacking = [k for k in stored if k not in out]
    if lacking:
        rows = db.by_vec_ids(lacking)
        vecs = embedder.encode([embed_text(r.title, r.text) for r in rows.values()])  # [N, dim]
        fresh = dict(zip(rows, vecs))
        db.set_vectors(fresh)
        out.update(fresh)
    return out
