"""The retrieval benchmark's embedding cache: the same texts by the same embedder are read back, not
embedded again; other texts or another embedder miss."""

from __future__ import annotations

import numpy as np

from benchmarks.recall.retrieval import cached_encode
from tests.retrieval.test_passage_store import HashEmbedder


class Counting(HashEmbedder):
    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        return super().encode(texts)


def test_embeddings_are_cached_per_embedder_and_texts(tmp_path):
    emb = Counting()
    first = cached_encode(emb, ["a", "b"], tmp_path)
    assert emb.calls == 2 and len(list(tmp_path.glob("*.npy"))) == 1
    again = cached_encode(emb, ["a", "b"], tmp_path)
    assert emb.calls == 2 and np.array_equal(first, again)  # read back, not embedded
    cached_encode(emb, ["b", "a"], tmp_path)  # another order is another key
    assert emb.calls == 4
    other = Counting()
    other.name = "hash-8-other"
    cached_encode(other, ["a", "b"], tmp_path)
    assert other.calls == 2 and len(list(tmp_path.glob("*.npy"))) == 3
    assert cached_encode(emb, ["a"], None).shape == (1, 8) and emb.calls == 5  # no cache dir: always embedded
