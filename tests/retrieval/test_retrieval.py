"""Retrieval: FAISS index kinds and persistence, placement, embedder, reconcile, real search."""

from __future__ import annotations

import json

import numpy as np
import pytest

from retrieval.embedder import Embedder, bundled_model_dir
from retrieval.index import INDEX_FILE, IndexParams, VectorIndex
from retrieval.passages import PassageDB, PassageRow, passage_id, vec_id_of
from retrieval.retriever import RetrievedPassage, Retriever, open_index, place
from tests.helpers import ROOT

SAMPLE = ROOT / "sample_corpus" / "hotpotqa_sample.jsonl"


def unit_vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_index_add_search_remove_persist(tmp_path, kind):
    params = IndexParams(kind=kind, ivf_min_train=400, ivf_nprobe=64)
    index = VectorIndex(32, params, "label")
    vecs = unit_vectors(600, 32)
    ids = np.arange(600, dtype=np.int64) * 11 + (1 << 40)
    index.add(ids[:300], vecs[:300])
    index.add(ids[300:], vecs[300:])
    assert index.kind == ("hnsw" if kind == "hnsw" else ("ivf" if kind == "ivf" else "flat"))
    scores, found = index.search(vecs[[3, 450]], 5)
    assert found[:, 0].tolist() == [ids[3], ids[450]]
    assert scores[0, 0] == pytest.approx(1.0, abs=1e-4) and scores[0, 0] >= scores[0, 1]
    assert index.remove(ids[[3, 7]]) == 2 and index.remove(ids[[3]]) == 0
    assert ids[3] not in index and len(index) == 598
    assert index.search(vecs[3:4], 1)[1][0, 0] != ids[3]
    index.save(tmp_path)
    loaded = VectorIndex.load(tmp_path, 32, params, "label")
    assert loaded is not None and len(loaded) == 598 and loaded.kind == index.kind
    assert loaded.search(vecs[9:10], 1)[1][0, 0] == ids[9]
    assert VectorIndex.load(tmp_path, 32, params, "other-embedder") is None  # built for something else
    assert VectorIndex.load(tmp_path, 16, params, "label") is None


def test_index_add_replaces_existing_ids_and_handles_small_k_and_empty(tmp_path):
    index = VectorIndex(8)
    assert index.search(unit_vectors(1, 8), 3)[1].shape == (1, 0)
    v = unit_vectors(3, 8)
    index.add(np.array([1, 2, 3]), v)
    index.add(np.array([1]), v[2:3])  # id 1 now holds vector 2
    assert len(index) == 3
    scores, found = index.search(v[2:3], 10)
    assert found.shape == (1, 3) and sorted(found[0, :2].tolist()) == [1, 3]
    with pytest.raises(ValueError):
        index.add(np.array([5, 5]), unit_vectors(2, 8))


def test_corrupt_index_file_is_ignored(tmp_path):
    index = VectorIndex(8)
    index.add(np.array([1]), unit_vectors(1, 8))
    index.save(tmp_path)
    (tmp_path / INDEX_FILE).write_bytes(b"garbage")
    assert VectorIndex.load(tmp_path, 8, IndexParams(), "") is None


def test_placement_policies():
    ps = [RetrievedPassage(str(i), "d", "t", "x", s) for i, s in enumerate([0.2, 0.9, 0.5])]
    assert [p.score for p in place(ps, "score")] == [0.9, 0.5, 0.2]
    assert [p.score for p in place(ps, "best_last")] == [0.2, 0.5, 0.9]
    with pytest.raises(ValueError):
        place(ps, "random")


def test_embedder_is_bundled_normalized_and_semantic(embedder):
    assert bundled_model_dir().name == "model" and embedder.dim == 384
    v = embedder.encode(["A cat sat on the mat.", "A kitten was sitting on a rug.", "Stock markets fell sharply."])
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2
    with pytest.raises(ValueError, match="not a local"):
        Embedder("/nonexistent/model-dir")


def _rows(records: list[dict]) -> list[PassageRow]:
    rows = []
    for i, r in enumerate(records):
        pid = passage_id(r["doc_id"], r["title"], r["text"])
        rows.append(PassageRow(pid, vec_id_of(pid), r["doc_id"], 0, r["title"], r["text"], r["source"], 10 + i, f"k{i}"))
    return rows


def test_retriever_finds_the_gold_passage_in_the_sample_corpus(tmp_path, embedder):
    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:30]]
    db = PassageDB(tmp_path / "p.sqlite3")
    db.upsert(_rows(records))
    index, info = open_index(tmp_path, db, embedder, IndexParams())
    assert (info["loaded"], info["added"]) == (False, 30)
    retriever = Retriever(embedder, index, db, placement="score")
    hits = retriever.search("In what year was the university where Sergei Aleksandrovich Tokarev was a professor "
                            "founded?", k=5)
    titles = [h.title for h in hits]
    assert "Sergei Aleksandrovich Tokarev" in titles[:2] and "Moscow State University" in titles
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert Retriever(embedder, index, db, placement="best_last").search("Tokarev professor", k=3)[-1].score == max(
        h.score for h in retriever.search("Tokarev professor", k=3))
    db.close()


def test_open_index_reconciles_with_sqlite(tmp_path, embedder):
    records = [{"doc_id": f"d{i}", "title": f"T{i}", "text": f"Passage number {i} about item {i}.", "source": "t"}
               for i in range(6)]
    rows = _rows(records)
    db = PassageDB(tmp_path / "p.sqlite3")
    db.upsert(rows[:4])
    index, _ = open_index(tmp_path, db, embedder, IndexParams())
    index.add(np.array([123456]), embedder.encode(["a stray vector no passage owns"]))
    index.save(tmp_path)
    db.upsert(rows[4:])  # committed to SQLite, the index never saw them (a crash before its save)
    index2, info = open_index(tmp_path, db, embedder, IndexParams())
    assert (info["loaded"], info["caught_up"] + info["added"], info["removed"]) == (True, 2, 1)
    assert sorted(index2.ids().tolist()) == sorted(r.vec_id for r in rows)
    index3, info3 = open_index(tmp_path, db, embedder, IndexParams())
    assert (info3["loaded"], info3["added"], info3["removed"]) == (True, 0, 0) and len(index3) == 6
    db.close()


def test_passage_db_transactions_and_counts(tmp_path):
    db = PassageDB(tmp_path / "p.sqlite3")
    rows = _rows([{"doc_id": "a", "title": "A", "text": f"t{i}", "source": "s"} for i in range(3)])
    db.upsert(rows)
    bad = [rows[0], PassageRow("x", rows[1].vec_id, "b", 0, "B", "t", "s", 1, "k")]  # vec_id clash -> whole batch fails
    with pytest.raises(Exception, match="UNIQUE"):
        db.upsert(bad)
    c = db.counts()
    assert (c["passages"], c["documents"], c["tokens"]) == (3, 1, 10 + 11 + 12)
    assert [r.id for r in db.delete_document("a")] == [r.id for r in rows] and db.counts()["passages"] == 0
    db.close()
