"""Passage store: SQLite (standard library), the source of truth for what is ingested.

One row per passage: id (content-derived), vector id (its FAISS id), document id, position in
the document, title, text, source, token count, KV key and ingestion time.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS passages (
    id          TEXT PRIMARY KEY,
    vec_id      INTEGER NOT NULL UNIQUE,
    doc_id      TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    title       TEXT NOT NULL,
    text        TEXT NOT NULL,
    source      TEXT NOT NULL,
    token_count INTEGER NOT NULL,
    kv_key      TEXT NOT NULL,
    ingested_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS passages_doc ON passages(doc_id);
CREATE INDEX IF NOT EXISTS passages_kv ON passages(kv_key);
"""
_COLUMNS = ("id", "vec_id", "doc_id", "seq", "title", "text", "source", "token_count", "kv_key", "ingested_at")
_UPDATE = ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[1:])


@dataclass(frozen=True)
class PassageRow:
    id: str
    vec_id: int
    doc_id: str
    seq: int
    title: str
    text: str
    source: str
    token_count: int
    kv_key: str
    ingested_at: float = 0.0


class PassageDB:
    """Thread-safe (one connection, check_same_thread=False, a lock). WAL journal."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ------------------------------------------------------------------ writes (one transaction each)
    def upsert(self, rows: Sequence[PassageRow]) -> None:
        """Insert or update rows (by id) in one transaction: all of them are stored, or none.

        A vec_id owned by another passage is an error (IntegrityError), never a silent replace."""
        now = time.time()
        values = [tuple(getattr(r, c) for c in _COLUMNS[:-1]) + (r.ingested_at or now,) for r in rows]
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(
                    f"INSERT INTO passages ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
                    f"ON CONFLICT(id) DO UPDATE SET {_UPDATE}",
                    values,
                )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def set_kv(self, passage_id: str, kv_key: str, token_count: int) -> None:
        with self._lock:
            self._conn.execute("UPDATE passages SET kv_key = ?, token_count = ? WHERE id = ?",
                               (kv_key, token_count, passage_id))

    def delete_document(self, doc_id: str) -> list[PassageRow]:
        """Remove a document's passages in one transaction; returns the removed rows."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                rows = self._rows("SELECT * FROM passages WHERE doc_id = ? ORDER BY seq", (doc_id,))
                self._conn.execute("DELETE FROM passages WHERE doc_id = ?", (doc_id,))
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return rows

    # ------------------------------------------------------------------ reads
    def _rows(self, sql: str, args: Iterable = ()) -> list[PassageRow]:
        with self._lock:
            cur = self._conn.execute(sql, tuple(args))
            return [PassageRow(**dict(r)) for r in cur.fetchall()]

    def get_many(self, ids: Sequence[str]) -> dict[str, PassageRow]:
        out: dict[str, PassageRow] = {}
        for i in range(0, len(ids), 500):
            part = list(ids[i:i + 500])
            q = f"SELECT * FROM passages WHERE id IN ({', '.join('?' * len(part))})"
            out.update((r.id, r) for r in self._rows(q, part))
        return out

    def by_vec_ids(self, vec_ids: Sequence[int]) -> dict[int, PassageRow]:
        vec_ids = [int(v) for v in vec_ids]
        if not vec_ids:
            return {}
        q = f"SELECT * FROM passages WHERE vec_id IN ({', '.join('?' * len(vec_ids))})"
        return {r.vec_id: r for r in self._rows(q, vec_ids)}

    def document(self, doc_id: str) -> list[PassageRow]:
        return self._rows("SELECT * FROM passages WHERE doc_id = ? ORDER BY seq", (doc_id,))

    def all_rows(self) -> list[PassageRow]:
        return self._rows("SELECT * FROM passages ORDER BY doc_id, seq")

    def vec_ids(self) -> set[int]:
        with self._lock:
            return {int(r[0]) for r in self._conn.execute("SELECT vec_id FROM passages")}

    def kv_keys(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._conn.execute("SELECT DISTINCT kv_key FROM passages")}

    def key_in_use(self, kv_key: str) -> bool:
        with self._lock:
            return self._conn.execute("SELECT 1 FROM passages WHERE kv_key = ? LIMIT 1", (kv_key,)).fetchone() is not None

    def counts(self) -> dict:
        with self._lock:
            r = self._conn.execute(
                "SELECT COUNT(*), COUNT(DISTINCT doc_id), COALESCE(SUM(token_count), 0), COUNT(DISTINCT kv_key), "
                "MIN(ingested_at), MAX(ingested_at) FROM passages"
            ).fetchone()
        return {"passages": r[0], "documents": r[1], "tokens": r[2], "kv_keys": r[3],
                "first_ingested_at": r[4], "last_ingested_at": r[5]}


def passage_id(doc_id: str, title: str, text: str) -> str:
    """Content-derived passage id: the same paragraph of the same document always gets the same id."""
    h = hashlib.sha256("\x1f".join((doc_id, title.strip(), text.strip())).encode())
    return h.hexdigest()[:32]


def vec_id_of(pid: str) -> int:
    """The passage's FAISS id: 60 bits of its (hex) id, so always a positive int64."""
    return int(pid[:15], 16)
