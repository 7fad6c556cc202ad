"""SQLite passage store (standard library): the embedded default, one file in the data dir.

Writes run under BEGIN IMMEDIATE, so change sequence numbers are handed out in commit order.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from retrieval.lexical import NO_FILTERS, Filters
from retrieval.passage_store import PassageConflict, PassageStore, PassageStoreError, SchemaTooNew
from retrieval.schema import (
    FTS_BACKFILL,
    FTS_TABLE,
    SCHEMA_VERSION,
    added_columns,
    embedding_column,
    schema,
    search_schema,
)


def _match(terms: Sequence[str]) -> str:
    """An FTS5 query matching any of the terms, each a quoted phrase (no operator survives)."""
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in terms)


class _SqliteRunner:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __call__(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        return [tuple(r) for r in self._conn.execute(sql, tuple(args)).fetchall()]

    def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)


class PassageDB(PassageStore):
    """SQLite backend. Thread-safe (one connection, check_same_thread=False, a lock). WAL journal."""

    backend = "sqlite"
    _NOW = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA busy_timeout=10000")
            self._migrate()

    def _migrate(self) -> None:
        found = self.schema_version()
        if found > SCHEMA_VERSION:
            self._conn.close()
            raise SchemaTooNew(found, where=str(self.path))
        if found == SCHEMA_VERSION:
            return
        with self._write():
            cols = {r[1] for r in self._conn.execute("PRAGMA table_info(passages)")}
            if cols and "embedding" not in cols:  # version 1: the passages table without embeddings
                self._conn.execute(f"ALTER TABLE passages ADD COLUMN {embedding_column('sqlite')}")
            for stmt in schema("sqlite"):
                self._conn.execute(stmt)
            for table, column, stmt in added_columns("sqlite"):  # SQLite has no ADD COLUMN IF NOT EXISTS
                if column not in {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}:
                    self._conn.execute(stmt)
            for stmt in search_schema("sqlite"):
                self._conn.execute(stmt)
            if 0 < found < 4:  # rows stored before the lexical index existed: index them (version <= 3)
                self._conn.execute(FTS_BACKFILL)
            self._conn.execute("INSERT OR REPLACE INTO store_meta (key, value) VALUES ('schema_version', ?)",
                               (str(SCHEMA_VERSION),))

    def schema_version(self) -> int:
        with self._lock:
            tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "store_meta" in tables:
                row = self._conn.execute("SELECT value FROM store_meta WHERE key = 'schema_version'").fetchone()
                if row is not None:
                    return int(row[0])
            return 1 if "passages" in tables else 0

    def describe(self) -> str:
        return f"sqlite:{self.path}"

    def lexical_search(self, terms: Sequence[str], k: int, filters: Filters = NO_FILTERS,
                       title_weight: float = 1.0) -> list[tuple[int, float]]:
        """FTS5 with BM25 (title and text, porter stemming; a title hit counts `title_weight` times a text
        hit, BM25F-style): any of the terms, each a quoted phrase."""
        if not terms or k <= 0:
            return []
        where, args = filters.sql()
        rows = self._fetch(f"SELECT p.vec_id, bm25({FTS_TABLE}, ?, 1.0) AS rank FROM {FTS_TABLE} JOIN passages p "
                           f"ON p.vec_id = {FTS_TABLE}.rowid WHERE {FTS_TABLE} MATCH ? AND {where} "
                           "ORDER BY rank, p.vec_id LIMIT ?", (float(title_weight), _match(terms), *args, int(k)))
        return [(int(v), -float(rank)) for v, rank in rows]  # bm25() is lower-is-better

    def lexical_scores(self, terms: Sequence[str], vec_ids: Sequence[int],
                       title_weight: float = 1.0) -> dict[int, float]:
        """The `lexical_search` score of each of `vec_ids` (0.0 where a passage matches none of the terms)."""
        out = dict.fromkeys((int(v) for v in vec_ids), 0.0)
        if not terms or not out:
            return out
        ids = list(out)
        for start in range(0, len(ids), 500):
            part = ids[start:start + 500]
            rows = self._fetch(f"SELECT rowid, bm25({FTS_TABLE}, ?, 1.0) FROM {FTS_TABLE} WHERE {FTS_TABLE} MATCH ? "
                               f"AND rowid IN ({', '.join('?' * len(part))})",
                               (float(title_weight), _match(terms), *part))
            out.update((int(v), -float(rank)) for v, rank in rows)
        return out

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _fetch(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            return _SqliteRunner(self._conn)(sql, args)

    @contextmanager
    def _write(self) -> Iterator[_SqliteRunner]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteRunner(self._conn)
                self._conn.execute("COMMIT")
            except BaseException as exc:
                if self._conn.in_transaction:  # SQLite may have rolled back itself (a full disk at COMMIT)
                    self._conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.IntegrityError):
                    raise PassageConflict(str(exc)) from exc
                if isinstance(exc, sqlite3.DatabaseError):  # disk full, I/O error: name the cause
                    raise PassageStoreError(f"passage store write failed: {exc}") from exc
                raise
