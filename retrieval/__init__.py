"""Retrieval: sentence embeddings, a FAISS index and a SQLite passage store."""

from retrieval.embedder import Embedder
from retrieval.index import IndexParams, VectorIndex
from retrieval.passages import PassageDB, PassageRow, passage_id, vec_id_of
from retrieval.retriever import RetrievedPassage, Retriever, open_index, place, reconcile

__all__ = [
    "Embedder", "IndexParams", "PassageDB", "PassageRow", "RetrievedPassage", "Retriever", "VectorIndex",
    "open_index", "passage_id", "place", "reconcile", "vec_id_of",
]
