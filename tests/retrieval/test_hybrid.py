"""Lexical search inside the passage store (SQLite FTS5, PostgreSQL full-text search), metadata filters,
reciprocal rank fusion, the schema-4 migration that indexes passages stored before it, and the
retriever's three modes, on both backends."""

from __future__ import annotations

import json
import sqlite3
import uuid
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest

from retrieval.index import IndexParams
from retrieval.lexical import Filters, fuse, query_terms
from retrieval.passages import SCHEMA_VERSION, PassageDB
from retrieval.retriever import Retriever, open_index
from tests.retrieval.test_passage_store import HashEmbedder, rows_of, vectors_of

V3 = json.loads((Path(__file__).parent / "schema_v3.json").read_text())

TEXTS = {
    "wiki/ferry": ["The Kvarken ferry crosses the Gulf of Bothnia twice a day.", "Tickets cost 42 euros in summer."],
    "wiki/capital": ["Helsinki is the capital of Finland.", "Its harbour freezes in hard winters."],
    "news/2024": ["A storm closed the harbours of the Baltic coast."],
    "wiki%_odd": ["A document id with LIKE wildcards in it."],
}


def fill(db, emb: HashEmbedder, at: dict[str, float] | None = None):
    rows = []
    for doc_id, texts in TEXTS.items():
        source = doc_id.split("/")[0] if "/" in doc_id else "odd"
        rows += [replace(r, source=source, ingested_at=(at or {}).get(doc_id, 1000.0)) for r in rows_of(doc_id, texts)]
    db.upsert(rows, vectors_of(rows, emb))
    return {r.text: r for r in rows}


def docs(db, hits) -> list[str]:
    rows = db.by_vec_ids([v for v, _ in hits])
    return [rows[v].doc_id for v, _ in hits]


def test_query_terms_drop_function_words_and_punctuation():
    assert query_terms("What is the capital of Finland? (Helsinki's, 42)") == ["capital", "finland", "helsinki", "s", "42"]
    assert query_terms('" OR NEAR( * "') == ["near"]  # FTS5 and tsquery syntax become plain words


def test_reciprocal_rank_fusion_rewards_agreement():
    fused = fuse([[1, 2, 3], [3, 4]])
    assert [i for i, _ in fused] == [3, 1, 2, 4]
    assert fused[0][1] == pytest.approx(1 / 63 + 1 / 61)


def test_lexical_search_finds_words_numbers_and_stems(open_store):
    db = open_store()
    fill(db, HashEmbedder())
    assert docs(db, db.lexical_search(query_terms("Kvarken"), 5)) == ["wiki/ferry"]
    assert docs(db, db.lexical_search(query_terms("How much is 42?"), 5)) == ["wiki/ferry"]
    assert set(docs(db, db.lexical_search(query_terms("harbour"), 5))) == {"wiki/capital", "news/2024"}  # harbours
    assert db.lexical_search(query_terms("zeppelin"), 5) == []
    assert db.lexical_search([], 5) == []
    top = db.lexical_search(query_terms("capital Finland winters"), 5)
    assert docs(db, top)[0] == "wiki/capital" and top[0][1] >= top[-1][1]


def test_filters_on_both_searches(open_store):
    db = open_store()
    emb = HashEmbedder()
    fill(db, emb, at={"news/2024": 2000.0})
    words = query_terms("harbour storm ferry kvarken wildcards")
    assert set(docs(db, db.lexical_search(words, 10, Filters(source="news")))) == {"news/2024"}
    assert set(docs(db, db.lexical_search(words, 10, Filters(doc_id_prefix="wiki/")))) == {"wiki/ferry", "wiki/capital"}
    assert set(docs(db, db.lexical_search(words, 10, Filters(doc_id_prefix="wiki%")))) == {"wiki%_odd"}  # no wildcard
    assert set(docs(db, db.lexical_search(words, 10, Filters(ingested_after=1500.0)))) == {"news/2024"}
    assert "news/2024" not in docs(db, db.lexical_search(words, 10, Filters(ingested_before=2000.0)))
    assert db.matching(list(db.vec_ids()), Filters(source="odd", doc_id_prefix="wiki")) == {
        r.vec_id for r in db.document("wiki%_odd")}
    assert set(db.filtered_vectors(Filters(source="wiki"), 100)) == {r.vec_id for d in ("wiki/ferry", "wiki/capital")
                                                                    for r in db.document(d)}


def test_the_lexical_index_follows_publish_and_delete(open_store):
    db = open_store()
    emb = HashEmbedder()
    fill(db, emb)
    new = rows_of("wiki/ferry", ["The Kvarken route now runs a hydrogen ferry."])
    db.stage(new, vectors_of(new, emb))
    db.publish(["wiki/ferry"])
    assert docs(db, db.lexical_search(["hydrogen"], 5)) == ["wiki/ferry"]
    assert db.lexical_search(["tickets"], 5) == []  # the old version's passage left the index
    db.delete_document("wiki/ferry")
    assert db.lexical_search(["kvarken", "hydrogen"], 5) == []
    db.upsert([replace(db.document("wiki/capital")[0], text="Tampere is not the capital.")])
    assert docs(db, db.lexical_search(["tampere"], 5)) == ["wiki/capital"] and db.lexical_search(["helsinki"], 5) == []


def _v3_store_with_rows(backend: str, where) -> None:
    """A schema-3 store (the statements version 3 ran) holding two passages, written without the lexical index."""
    rows = rows_of("old", ["Passages from before lexical search", "Kvarken ferry timetable"])
    values = [(r.id, r.vec_id, r.doc_id, r.seq, r.title, r.text, r.source, r.token_count, r.kv_key, 1.0) for r in rows]
    insert = "INSERT INTO passages (id, vec_id, doc_id, seq, title, text, source, token_count, kv_key, ingested_at) " \
             "VALUES ({})"
    if backend == "sqlite":
        with sqlite3.connect(where) as conn:
            for stmt in V3["sqlite"]:
                conn.execute(stmt)
            conn.execute("INSERT INTO store_meta (key, value) VALUES ('schema_version', '3')")
            conn.executemany(insert.format(", ".join("?" * 10)), values)
    else:
        with psycopg.connect(where, autocommit=True) as conn:
            for stmt in (*V3["postgresql"], *V3["postgresql_migration"]):
                conn.execute(stmt)
            conn.execute("INSERT INTO store_meta (key, value) VALUES ('schema_version', '3')")
            with conn.cursor() as cur:
                cur.executemany(insert.format(", ".join(["%s"] * 10)), values)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_version_3_store_is_migrated_and_its_passages_indexed(backend, tmp_path, request):
    if backend == "sqlite":
        where = tmp_path / "passages.sqlite3"
        _v3_store_with_rows(backend, where)
        db = PassageDB(where)
    else:
        from retrieval.passages_pg import PgPassageStore

        where = request.getfixturevalue("pg_cluster").create_database(f"m{uuid.uuid4().hex[:10]}")
        _v3_store_with_rows(backend, where)
        db = PgPassageStore(where)
    try:
        assert db.schema_version() == SCHEMA_VERSION == 5
        assert db.counts()["passages"] == 2  # nothing lost
        assert [r.location for r in db.document("old")] == ["", ""]  # version 5's column, empty for old rows
        assert docs(db, db.lexical_search(["kvarken"], 5)) == ["old"]
        more = rows_of("new", ["A Kvarken crossing written after the migration"])
        db.upsert(more)
        assert sorted(docs(db, db.lexical_search(["kvarken"], 5))) == ["new", "old"]
    finally:
        db.close()


def test_the_retriever_modes(open_store, tmp_path):
    db = open_store()
    emb = HashEmbedder()  # dense scores are arbitrary here: the lexical list decides what fusion adds
    by_text = fill(db, emb)
    index, _ = open_index(tmp_path / "index", db, emb, IndexParams())
    retriever = Retriever(emb, index, db, placement="score", mode="hybrid", candidates=10)
    ferry = by_text["The Kvarken ferry crosses the Gulf of Bothnia twice a day."].id
    assert [p.id for p in retriever.search("Kvarken", 1, mode="lexical")] == [ferry]
    assert retriever.search("Kvarken", 1)[0].id == ferry  # the only lexical hit is also a dense hit: first
    dense = retriever.search("Kvarken", 6, mode="dense")
    assert len(dense) == 6 and dense == sorted(dense, key=lambda p: -p.score)
    only_news = retriever.search("Kvarken harbour", 3, mode="dense", filters=Filters(source="news"))
    assert [p.doc_id for p in only_news] == ["news/2024"]  # the exact scan of the filtered set
    assert {p.doc_id for p in retriever.search("harbour", 5, filters=Filters(doc_id_prefix="wiki/"))} <= {
        "wiki/ferry", "wiki/capital"}
    with pytest.raises(ValueError, match="retrieval must be one of"):
        retriever.search("Kvarken", 1, mode="sparse")
