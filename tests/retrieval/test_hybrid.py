"""Lexical search inside the passage store (SQLite FTS5, PostgreSQL full-text search), metadata filters,
reciprocal rank fusion, the schema-4 migration that indexes passages stored before it, and the
retriever's three modes, on both backends."""

from __future__ import annotations

import json
import sqlite3
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import psycopg
import pytest

from retrieval.index import IndexParams
from retrieval.lexical import Filters, Fusion, convex, fuse, min_max, query_terms
from retrieval.passages import SCHEMA_VERSION, PassageDB, PassageRow, passage_id, vec_id_of
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
        assert db.schema_version() == SCHEMA_VERSION == 6
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
    retriever = Retriever(emb, index, db, placement="score", mode="hybrid", fusion=Fusion(candidates=10))
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


def test_weighted_reciprocal_rank_fusion_follows_the_heavier_list():
    dense, lexical = [1, 2, 3], [3, 2, 1]
    assert [i for i, _ in fuse([dense, lexical], 60, (0.5, 0.5))] == [1, 3, 2]  # 1 and 3 tie (by id), ahead of 2
    assert [i for i, _ in fuse([dense, lexical], 60, (0.7, 0.3))] == [1, 2, 3]
    assert [i for i, _ in fuse([dense, lexical], 60, (0.3, 0.7))] == [3, 2, 1]
    assert fuse([dense, lexical], 10, (0.7, 0.3))[0][1] == pytest.approx(0.7 / 11 + 0.3 / 13)
    with pytest.raises(ValueError, match="2 weights for 1 rankings"):
        fuse([dense], 60, (0.5, 0.5))


def test_convex_fusion_combines_min_max_normalised_scores():
    dense = {1: 0.9, 2: 0.5, 3: 0.1}  # normalised: 1.0, 0.5, 0.0
    lexical = {1: 0.0, 2: 10.0, 3: 5.0}  # normalised: 0.0, 1.0, 0.5
    even = convex(dense, lexical, 0.5)
    assert [i for i, _ in even] == [2, 1, 3] and [s for _, s in even] == pytest.approx([0.75, 0.5, 0.25])
    assert [i for i, _ in convex(dense, lexical, 0.9)] == [1, 2, 3]
    assert [i for i, _ in convex(dense, lexical, 0.0)] == [2, 3, 1]
    assert min_max({7: 3.0, 8: 3.0}) == {7: 1.0, 8: 1.0} and min_max({}) == {}
    assert convex({1: 0.5}, {2: 4.0}, 0.5) == [(1, 0.5), (2, 0.5)]  # one-sided ids: the other side's floor, 0


@pytest.mark.parametrize("bad, match", [({"method": "sum"}, "fusion must be one of"),
                                        ({"dense_weight": 1.5}, "dense_weight must be within"),
                                        ({"rrf_k": -1}, "rrf_k must be"), ({"candidates": 0}, "candidates must be")])
def test_a_bad_fusion_fails_at_once(bad, match):
    with pytest.raises(ValueError, match=match):
        Fusion(**bad)


def _titled(doc_id: str, title: str, text: str) -> PassageRow:
    pid = passage_id(doc_id, title, text)
    return PassageRow(pid, vec_id_of(pid), doc_id, 0, title, text, "test", 10, f"kv-{pid[:8]}")


def test_the_title_weight_lets_a_title_match_outrank_text_matches(open_store):
    db = open_store()
    in_title = _titled("a", "Kvarken", "A strait between Finland and Sweden with many small islands.")
    in_text = _titled("b", "Ferries", "Kvarken ferries: the Kvarken crossing runs twice a day from Vaasa.")
    other = _titled("c", "Helsinki", "The capital of Finland.")
    db.upsert([in_title, in_text, other])
    plain = db.lexical_search(["kvarken"], 5)
    assert docs(db, plain) == ["b", "a"]  # two text matches beat one title match when both count the same
    boosted = db.lexical_search(["kvarken"], 5, title_weight=10.0)
    assert docs(db, boosted) == ["a", "b"]
    # lexical_scores gives the very scores lexical_search ranks by, and 0.0 for a passage matching no term
    for weight, hits in ((1.0, plain), (10.0, boosted)):
        scores = db.lexical_scores(["kvarken"], [v for v, _ in hits] + [other.vec_id], title_weight=weight)
        assert scores == pytest.approx({**dict(hits), other.vec_id: 0.0})
    assert db.lexical_scores([], [other.vec_id]) == {other.vec_id: 0.0}


def test_convex_hybrid_scores_every_candidate_on_both_sides(open_store, tmp_path):
    db = open_store()
    emb = HashEmbedder()
    fill(db, emb)
    index, _ = open_index(tmp_path / "index", db, emb, IndexParams())
    question = "Kvarken ferry tickets"
    fusion = Fusion("convex", dense_weight=0.6, candidates=2)
    retriever = Retriever(emb, index, db, placement="score", mode="hybrid", fusion=fusion, title_weight=2.0)
    got = retriever.hybrid(question, 2)
    # by hand: the union of both top-2 lists, each passage's cosine and lexical score, min-max, 0.6 / 0.4
    q = emb.encode([question])[0]
    dense = dict(retriever.dense(question, 2))
    lexical = dict(db.lexical_search(query_terms(question), 2, title_weight=2.0))
    union = sorted({*dense, *lexical})
    assert set(union) - set(dense) and set(union) - set(lexical)  # the lists differ, so both sides fill gaps
    vectors = db.vectors(union)
    cos = {i: float(vectors[i] @ q) for i in union}
    lex = db.lexical_scores(query_terms(question), union, title_weight=2.0)
    assert lex == pytest.approx({i: lexical.get(i, lex[i]) for i in union})
    expected = convex(cos, lex, 0.6)[:2]
    assert [i for i, _ in got] == [i for i, _ in expected]
    assert [s for _, s in got] == pytest.approx([s for _, s in expected])
    assert [p.id for p in retriever.search(question, 2)] == [db.by_vec_ids([i])[i].id for i, _ in expected]


V5_SEARCH = ("ALTER TABLE passages ADD COLUMN search tsvector GENERATED ALWAYS AS "
             "(to_tsvector('english'::regconfig, title || ' ' || text)) STORED",
             "CREATE INDEX passages_search ON passages USING GIN (search)")  # version 5's unweighted column


def test_a_version_5_postgresql_store_gets_the_weighted_search_column(pg_cluster):
    from retrieval.passages_pg import PgPassageStore

    url = pg_cluster.create_database(f"v5{uuid.uuid4().hex[:10]}")
    PgPassageStore(url).close()
    with psycopg.connect(url, autocommit=True) as conn:  # back to version 5: the column without weights
        conn.execute("ALTER TABLE passages DROP COLUMN search")
        for stmt in V5_SEARCH:
            conn.execute(stmt)
        conn.execute("UPDATE store_meta SET value = '5' WHERE key = 'schema_version'")
    with psycopg.connect(url, autocommit=True) as conn:  # rows as version 5 held them
        rows = [_titled("a", "Kvarken", "A strait with islands."), _titled("b", "Ferries", "Kvarken, Kvarken, Kvarken.")]
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO passages (id, vec_id, doc_id, seq, title, text, source, token_count, kv_key, "
                            "ingested_at) VALUES (%s, %s, %s, 0, %s, %s, 'test', 10, 'k', 1.0)",
                            [(r.id, r.vec_id, r.doc_id, r.title, r.text) for r in rows])
        before = [r[0] for r in conn.execute("SELECT search::text FROM passages ORDER BY doc_id")]
    assert before[0] == "'island':5 'kvarken':1 'strait':3"  # unweighted: every position class D (not shown)
    db = PgPassageStore(url)
    try:
        assert db.schema_version() == SCHEMA_VERSION == 6
        with psycopg.connect(url) as conn:
            after = [r[0] for r in conn.execute("SELECT search::text FROM passages ORDER BY doc_id")]
        assert after[0] == "'island':5B 'kvarken':1A 'strait':3B"  # title words A, text words B
        assert db.counts()["passages"] == 2  # nothing lost
        assert docs(db, db.lexical_search(["kvarken"], 5)) == ["b", "a"]
        assert docs(db, db.lexical_search(["kvarken"], 5, title_weight=10.0)) == ["a", "b"]  # the title counts now
    finally:
        db.close()


@pytest.mark.parametrize("field, value", [("hybrid_fusion", "sum"), ("hybrid_dense_weight", "1.2"),
                                          ("hybrid_dense_weight", "-0.1"), ("hybrid_rrf_k", "-1"),
                                          ("lexical_title_weight", "0"), ("hybrid_candidates", "0")])
def test_fusion_settings_fail_fast_naming_the_field(field, value, monkeypatch):
    from pydantic import ValidationError

    from blendserve_config.settings import Settings

    monkeypatch.setenv(f"BLENDSERVE_{field.upper()}", value)
    with pytest.raises(ValidationError, match=field):
        Settings(_env_file=None)


def test_fusion_settings_reach_the_retriever(monkeypatch):
    from blendserve_config.settings import Settings
    from blendserve_config.stack import fusion_of

    for name, value in (("HYBRID_FUSION", "rrf"), ("HYBRID_DENSE_WEIGHT", "0.3"), ("HYBRID_RRF_K", "10"),
                        ("HYBRID_CANDIDATES", "20")):
        monkeypatch.setenv(f"BLENDSERVE_{name}", value)
    assert fusion_of(Settings(_env_file=None)) == Fusion("rrf", 0.3, 10, 20)


class FixedQuestion:
    """An embedder whose every question is the first axis (passages carry the vectors they are stored with)."""

    name, dim = "fixed-4", 4

    def encode(self, texts: list[str]) -> np.ndarray:
        return np.tile(np.eye(4, dtype=np.float32)[:1], (len(texts), 1))  # [N, 4]


def test_convex_fusion_scores_lexical_hits_by_their_real_cosine(open_store, tmp_path):
    db = open_store()

    def unit(cos: float) -> np.ndarray:
        return np.array([cos, np.sqrt(1 - cos * cos), 0, 0], dtype=np.float32)

    rows = {name: _titled(name, name.upper(), text) for name, text in
            (("d1", "alpha"), ("d2", "beta"), ("l1", "zeta zeta"), ("l2", "zeta and more words"), ("x", "omega"))}
    cosines = {"d1": 1.0, "d2": 0.9, "l1": 0.5, "l2": 0.2, "x": -1.0}
    db.upsert(list(rows.values()), {rows[n].vec_id: unit(c) for n, c in cosines.items()})
    emb = FixedQuestion()
    index, _ = open_index(tmp_path / "index", db, emb, IndexParams())
    retriever = Retriever(emb, index, db, placement="score", mode="hybrid", fusion=Fusion("convex", 0.6, candidates=2))
    got = retriever.hybrid("zeta", 2)
    # dense top 2: d1, d2; lexical top 2: l1, l2. l1's cosine 0.5 normalises to 0.375 over {1, 0.9, 0.5, 0.2}:
    # 0.6 * 0.375 + 0.4 * 1 = 0.625 beats d1's 0.6 (had l1 counted as the dense floor, 0.4 would lose to 0.6)
    assert [db.by_vec_ids([i])[i].doc_id for i, _ in got] == ["l1", "d1"]
    assert [s for _, s in got] == pytest.approx([0.625, 0.6])
