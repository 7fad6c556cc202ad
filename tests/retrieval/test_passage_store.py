"""The passage store on both backends (SQLite and a throwaway PostgreSQL cluster): transactions,
the change log, stored embeddings, concurrent writers, schema versions, and FAISS indexes of two
replicas kept in sync through the change log."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time

import numpy as np
import pytest

from retrieval.index import IndexParams
from retrieval.passages import (
    SCHEMA_VERSION,
    PassageConflict,
    PassageDB,
    PassageRow,
    SchemaTooNew,
    passage_id,
    vec_id_of,
)
from retrieval.retriever import open_index
from retrieval.sync import IndexSync


class HashEmbedder:
    """Deterministic unit vectors from text hashes; counts the texts it embedded."""

    name = "hash-8"
    dim = 8

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, texts: list[str]) -> np.ndarray:
        self.calls += len(texts)
        out = np.stack([np.frombuffer(hashlib.sha256(t.encode()).digest()[:32], dtype=np.uint8)[:8].astype(np.float32)
                        - 127.5 for t in texts]) if texts else np.zeros((0, 8), np.float32)  # [N, 8]
        return out / np.linalg.norm(out, axis=1, keepdims=True).clip(1e-6)


def rows_of(doc_id: str, texts: list[str]) -> list[PassageRow]:
    out = []
    for seq, text in enumerate(texts):
        pid = passage_id(doc_id, doc_id.upper(), text)
        out.append(PassageRow(pid, vec_id_of(pid), doc_id, seq, doc_id.upper(), text, "test", 10 + seq, f"kv-{pid[:8]}"))
    return out


def vectors_of(rows: list[PassageRow], emb: HashEmbedder) -> dict[int, np.ndarray]:
    return dict(zip((r.vec_id for r in rows), emb.encode([r.text for r in rows])))


def test_upsert_is_one_transaction_and_counts_add_up(open_store):
    db = open_store()
    rows = rows_of("a", ["t0", "t1", "t2"])
    assert sorted(db.upsert(rows)) == sorted(r.id for r in rows)
    clash = PassageRow("x" * 32, rows[1].vec_id, "b", 0, "B", "t", "s", 1, "k")  # vec_id owned by rows[1]
    with pytest.raises(PassageConflict):
        db.upsert([*rows_of("c", ["fresh"]), clash])
    c = db.counts()
    assert (c["passages"], c["documents"], c["tokens"]) == (3, 1, 10 + 11 + 12)
    assert db.get_many([r.id for r in rows_of("c", ["fresh"])]) == {}  # the batch's good row was rolled back too
    assert [r.id for r in db.document("a")] == [r.id for r in rows]
    assert db.key_in_use(rows[0].kv_key) and db.kv_keys() == {r.kv_key for r in rows}
    assert [r.id for r in db.delete_document("a")] == [r.id for r in rows] and db.counts()["passages"] == 0
    assert db.delete_document("a") == []


def test_change_log_has_one_add_per_insert_and_one_del_per_delete(open_store):
    db = open_store()
    assert db.head().seq == 0 and db.changes_since(0) == []
    rows = rows_of("a", ["t0", "t1", "t2"])
    db.upsert(rows)
    first = db.head().seq
    assert [(c.op, c.vec_id) for c in db.changes_since(0)] == [("add", r.vec_id) for r in rows]
    assert db.upsert([*rows, *rows_of("b", ["u0"])]) == [rows_of("b", ["u0"])[0].id]  # a re-upsert logs nothing new
    db.delete_document("a")
    log = db.changes_since(first)
    assert [(c.op, c.doc_id) for c in log] == [("add", "b"), ("del", "a"), ("del", "a"), ("del", "a")]
    seqs = [c.seq for c in db.changes_since(0)]
    assert seqs == sorted(set(seqs)) and db.head().seq == seqs[-1]
    assert [c.seq for c in db.changes_since(0, limit=2)] == seqs[:2]
    assert abs(db.head().now - log[-1].at) < 60  # the store's clock, in seconds since the epoch


def test_embeddings_are_kept_with_the_rows(open_store):
    db, emb = open_store(), HashEmbedder()
    rows = rows_of("a", ["t0", "t1"])
    vecs = vectors_of(rows, emb)
    db.upsert(rows[:1], vecs)
    db.upsert(rows[1:])  # no vector given
    got = db.vectors([r.vec_id for r in rows] + [12345])
    assert set(got) == {r.vec_id for r in rows}  # absent ids are left out
    np.testing.assert_array_equal(got[rows[0].vec_id], vecs[rows[0].vec_id])
    assert got[rows[1].vec_id] is None
    db.set_vectors({rows[1].vec_id: vecs[rows[1].vec_id]})
    np.testing.assert_array_equal(db.vectors([rows[1].vec_id])[rows[1].vec_id], vecs[rows[1].vec_id])
    db.upsert(rows)  # an update without vectors keeps the stored ones
    assert all(v is not None for v in db.vectors([r.vec_id for r in rows]).values())


def test_two_replicas_writing_overlapping_documents_lose_nothing_and_duplicate_nothing(open_store):
    """Two handles (two replicas) upsert overlapping batches at once while a third reads the log:
    every passage is stored once, logged once, and the reader sees every add in order."""
    a, b, reader = open_store(), open_store(), open_store()
    docs = {f"d{i}": rows_of(f"d{i}", [f"d{i} p{j}" for j in range(3)]) for i in range(40)}
    order_a = list(docs)
    order_b = order_a[20:] + order_a[:20]  # overlap on every document, in another order
    errors: list[BaseException] = []
    done = threading.Event()
    seen: list[int] = []

    def write(db, order):
        try:
            for d in order:
                db.upsert(docs[d])
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    def follow():
        gen = 0
        while True:
            finished = done.is_set()
            for c in reader.changes_since(gen):
                seen.append(c.seq)
                gen = c.seq
            if finished:
                return

    threads = [threading.Thread(target=write, args=(a, order_a)), threading.Thread(target=write, args=(b, order_b))]
    follower = threading.Thread(target=follow)
    follower.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    follower.join()
    assert not errors
    every = [r for rows in docs.values() for r in rows]
    assert reader.counts()["passages"] == len(every)
    log = reader.changes_since(0, limit=10_000)
    assert sorted(c.passage_id for c in log) == sorted(r.id for r in every)  # one add each, none lost
    assert seen == [c.seq for c in log]  # a live reader missed nothing: numbers follow commit order


def test_a_store_with_a_newer_schema_refuses_to_open(open_store):
    db = open_store()
    db.upsert(rows_of("a", ["t0"]))
    with db._write() as ex:
        ex("UPDATE store_meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    with pytest.raises(SchemaTooNew, match=rf"schema version {SCHEMA_VERSION + 1}, newer than this build supports "
                                           rf"\({SCHEMA_VERSION}\); upgrade"):
        open_store()


def test_a_version_1_sqlite_store_is_migrated_in_place(tmp_path):
    path = tmp_path / "passages.sqlite3"
    row = rows_of("a", ["old text"])[0]
    with sqlite3.connect(path) as conn:  # the layout before embeddings and the change log
        conn.execute("CREATE TABLE passages (id TEXT PRIMARY KEY, vec_id INTEGER NOT NULL UNIQUE, doc_id TEXT NOT "
                     "NULL, seq INTEGER NOT NULL, title TEXT NOT NULL, text TEXT NOT NULL, source TEXT NOT NULL, "
                     "token_count INTEGER NOT NULL, kv_key TEXT NOT NULL, ingested_at REAL NOT NULL)")
        conn.execute("INSERT INTO passages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (row.id, row.vec_id, row.doc_id, row.seq, row.title, row.text, row.source, row.token_count,
                      row.kv_key, 1.0))
    db = PassageDB(path)
    assert db.schema_version() == SCHEMA_VERSION and db.document("a")[0].text == "old text"
    assert db.vectors([row.vec_id]) == {row.vec_id: None} and db.head().seq == 0
    emb = HashEmbedder()
    index, info = open_index(tmp_path, db, emb, IndexParams())  # embeds the old row once and stores it
    assert info["added"] == 1 and emb.calls == 1 and db.vectors([row.vec_id])[row.vec_id] is not None
    db.close()


def test_replica_indexes_follow_the_change_log(open_store, tmp_path):
    """Replica A ingests and deletes; replica B's index catches up by applying the log, from
    stored embeddings (nothing re-embedded), and reports its generation and lag."""
    emb_a, emb_b = HashEmbedder(), HashEmbedder()
    db_a, db_b = open_store(), open_store()
    first = rows_of("old", ["already there"])
    db_a.upsert(first, vectors_of(first, emb_a))
    index_a, info_a = open_index(tmp_path / "a", db_a, emb_a, IndexParams())
    index_b, info_b = open_index(tmp_path / "b", db_b, emb_b, IndexParams())
    assert len(index_b) == 1 and emb_b.calls == 0  # built from the stored embedding
    sync_b = IndexSync(index_b, db_b, emb_b, info_b["generation"], interval_s=0.05)

    new = rows_of("new", ["fresh passage one", "fresh passage two"])
    vecs = vectors_of(new, emb_a)
    db_a.upsert(new, vecs)  # what replica A's pipeline does: store (logging adds), then its own index
    index_a.add(np.array([r.vec_id for r in new]), np.stack(list(vecs.values())))
    st = sync_b.poll()  # measures, applies nothing
    assert (st.lag_changes, st.generation) == (2, info_b["generation"])
    assert sync_b.step() == 2 and sync_b.status().lag_changes == 0 and sync_b.status().lag_s == 0
    assert sorted(index_b.ids().tolist()) == sorted(index_a.ids().tolist()) and emb_b.calls == 0
    _, ids = index_b.search(vecs[new[1].vec_id][None, :], 1)
    assert ids[0][0] == new[1].vec_id

    db_a.delete_document("new")
    index_a.remove(np.array([r.vec_id for r in new]))
    sync_b.start()  # the polling thread
    try:
        from tests.local_services import wait_for

        assert wait_for(lambda: len(index_b) == 1, timeout=5), "B never applied A's delete"
    finally:
        sync_b.stop()
    assert index_b.ids().tolist() == [first[0].vec_id] and sync_b.generation == db_b.head().seq


def test_add_then_delete_in_one_batch_leaves_nothing(open_store, tmp_path):
    emb = HashEmbedder()
    db = open_store()
    index, info = open_index(tmp_path, db, emb, IndexParams())
    rows = rows_of("gone", ["short-lived"])
    db.upsert(rows, vectors_of(rows, emb))
    db.delete_document("gone")
    again = rows_of("back", ["re-added"])
    db.upsert(again, vectors_of(again, emb))
    sync = IndexSync(index, db, emb, info["generation"])
    assert sync.step() == 3 and index.ids().tolist() == [again[0].vec_id]



def test_a_restarted_replica_catches_up_from_the_change_log(open_store, tmp_path):
    """The index saved with its generation; while the replica is down another one ingests and
    deletes; on restart the replica applies exactly those changes, and reconciling finds nothing."""
    emb = HashEmbedder()
    mine, other = open_store(), open_store()
    kept, dropped = rows_of("kept", ["stays"]), rows_of("dropped", ["goes away"])
    other.upsert(kept + dropped, vectors_of(kept + dropped, emb))
    index, info = open_index(tmp_path, mine, emb, IndexParams())
    assert index.generation == info["generation"] == 2 and len(index) == 2
    index.save(tmp_path)  # then the replica goes down
    late = rows_of("late", ["ingested while down", "and another"])
    other.upsert(late, vectors_of(late, emb))
    other.delete_document("dropped")
    calls = emb.calls
    index2, info2 = open_index(tmp_path, mine, emb, IndexParams())
    assert (info2["loaded"], info2["caught_up"], info2["added"], info2["removed"]) == (True, 3, 0, 0)
    assert sorted(index2.ids().tolist()) == sorted(r.vec_id for r in kept + late) and emb.calls == calls
    assert index2.generation == mine.head().seq == 5


def test_staged_documents_become_visible_whole_and_replace_the_old_version(open_store):
    """#18's semantics on both backends: staged rows are invisible (and name the document
    incomplete) until published in one transaction; publishing a new version of a doc_id removes
    the old version's passages, logging a `del` for each and an `add` for each new one."""
    db, other, emb = open_store(), open_store(), HashEmbedder()
    v1 = rows_of("doc", ["capacity 10 MW", "built 1990"])
    db.stage(v1, vectors_of(v1, emb))
    assert db.document("doc") == [] and other.incomplete() == {"doc": 2} and other.head().seq == 0
    removed, published = db.publish(["doc"])
    assert removed == [] and [r.id for r in published] == [r.id for r in v1]
    assert [r.id for r in other.document("doc")] == [r.id for r in v1] and other.incomplete() == {}
    assert all(v is not None for v in other.vectors([r.vec_id for r in v1]).values())  # embeddings travel along
    v2 = rows_of("doc", ["capacity 25 MW", "built 1990"])  # one passage changed, one the same
    other.stage(v2, vectors_of(v2, emb))
    removed, _ = other.publish(["doc"])
    assert [r.text for r in removed] == ["capacity 10 MW"]
    assert sorted(r.text for r in db.document("doc")) == ["built 1990", "capacity 25 MW"]
    log = db.changes_since(2)
    assert [(c.op, c.vec_id) for c in log] == [("del", v1[0].vec_id), ("add", v2[0].vec_id)]
    db.stage(rows_of("half", ["a crash left this"]))
    assert other.discard(["half"]) == 1 and db.incomplete() == {}


def test_postgres_going_away_is_a_storage_fault_and_comes_back(pg_cluster, tmp_path):
    """Reads and writes while PostgreSQL is down raise PassageStoreError (the service's 503), index
    sync reports the failure and keeps its generation; after a restart the same handle reconnects
    and sync catches up."""
    import uuid

    from retrieval.passages import PassageStoreError
    from retrieval.passages_pg import PgPassageStore

    url = pg_cluster.create_database(f"t{uuid.uuid4().hex[:12]}")
    db, emb = PgPassageStore(url), HashEmbedder()
    index, info = open_index(tmp_path, db, emb, IndexParams())
    sync = IndexSync(index, db, emb, info["generation"])
    rows = rows_of("a", ["before the outage"])
    db.upsert(rows, vectors_of(rows, emb))
    pg_cluster.stop()
    try:
        with pytest.raises(PassageStoreError, match="passage store"):
            db.counts()
        with pytest.raises(PassageStoreError, match="passage store"):
            db.upsert(rows_of("b", ["during the outage"]))
        sync.start()
        from tests.local_services import wait_for

        assert wait_for(lambda: sync.status().error, timeout=5), "sync never reported the outage"
        assert sync.generation == info["generation"]
        sync.stop()
    finally:
        pg_cluster.start()
    assert db.counts()["passages"] == 1  # reconnected
    assert sync.step() == 1 and sync.status().error is None and index.ids().tolist() == [rows[0].vec_id]
    db.close()


def test_postgres_notifies_followers_so_sync_beats_its_poll_interval(pg_cluster, tmp_path):
    """With LISTEN/NOTIFY a replica's index applies another replica's write long before its
    (here 30 s) poll interval; a wait with no write times out and says so."""
    import uuid

    from retrieval.passages_pg import PgPassageStore
    from tests.local_services import wait_for

    url = pg_cluster.create_database(f"t{uuid.uuid4().hex[:12]}")
    writer, follower, emb = PgPassageStore(url), PgPassageStore(url), HashEmbedder()
    assert follower.wait_for_change(0.2) is False  # nothing written: the wait runs out
    index, info = open_index(tmp_path, follower, emb, IndexParams())
    sync = IndexSync(index, follower, emb, info["generation"], interval_s=30.0)
    sync.start()
    try:
        time.sleep(0.3)  # the sync thread is listening
        rows = rows_of("a", ["announced"])
        writer.upsert(rows, vectors_of(rows, emb))
        assert wait_for(lambda: len(index) == 1, timeout=5), "the follower was not woken by NOTIFY"  # polls every 30 s
    finally:
        sync.stop()
    writer.close()
    follower.close()
