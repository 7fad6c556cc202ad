"""PostgreSQL passage store (psycopg 3): one store shared by every replica.

`BLENDSERVE_STORE_DATABASE_URL=postgresql://user:password@host:5432/db`. The tables are those of the
SQLite store (one definition, `retrieval.schema`, rendered for each dialect); the SQL is shared
(`retrieval.passage_store`), only connections, transactions and the column types differ.
Writes take a transaction-scoped advisory lock before their first change-log entry, so
`passage_changes.seq` is handed out in commit order (a follower never misses a change that
commits after a higher number it has already applied). Schema changes run under another
advisory lock, so replicas starting together do not race to create the tables.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from retrieval.lexical import NO_FILTERS, Filters
from retrieval.passage_store import PassageConflict, PassageStore, PassageStoreError, SchemaTooNew
from retrieval.schema import (
    SCHEMA_VERSION,
    TEXT_SEARCH_CONFIG,
    added_columns,
    embedding_column,
    schema,
    search_rebuild,
    search_schema,
)

logger = logging.getLogger(__name__)

CHANNEL = "blendserve_changes"  # NOTIFY channel: a write that logged changes wakes every replica's sync
WRITE_LOCK = 0x626C656E64  # pg_advisory_xact_lock key serializing change-log writers ("blend")
SCHEMA_LOCK = 0x736368656D  # ... and schema creation/migration ("schem")

# ts_rank with a weight per tsvector class {D, C, B, A}: text words are B, title words A (schema version 6).
# Text at D's default 0.1 keeps the scores of the unweighted column; the title counts `title_weight` times it.
_RANK = "ts_rank(?::real[], p.search, q)"
_TEXT_RANK_WEIGHT = 0.1


def _weights(title_weight: float) -> tuple[list[float]]:
    """ts_rank's weights argument for a title word counting `title_weight` times a text word."""
    w = _TEXT_RANK_WEIGHT
    return ([w, w, w, w * float(title_weight)],)


def redact_url(url: str) -> str:
    """postgresql://host:port/dbname, without user or password."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparsable url)"
    return f"postgresql://{parts.get('host', '')}:{parts.get('port', 5432)}/{parts.get('dbname', '')}"


def _pg(sql: str) -> str:
    return sql.replace("?", "%s")


class _PgRunner:
    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn

    def __call__(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        cur = self._conn.execute(_pg(sql), tuple(args))
        return [tuple(r) for r in cur.fetchall()] if cur.description is not None else []

    def many(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        with self._conn.cursor() as cur:
            cur.executemany(_pg(sql), [tuple(r) for r in rows])


class PgPassageStore(PassageStore):
    """Thread-safe: one autocommit connection behind a lock, reconnected when it breaks."""

    backend = "postgresql"
    _NOW = "extract(epoch from clock_timestamp())::double precision"

    def __init__(self, url: str, connect_timeout_s: float = 5.0, start_wait_s: float = 30.0) -> None:
        self.url = url
        self._where = redact_url(url)
        self._timeout = max(1, int(connect_timeout_s))
        self._lock = threading.RLock()
        self._conn: psycopg.Connection | None = None
        self._listener: psycopg.Connection | None = None  # LISTEN connection, used by the sync thread only
        deadline = time.monotonic() + start_wait_s
        with self._lock:
            while True:  # PostgreSQL may still be starting (a fresh container): wait for it, then migrate
                try:
                    self._migrate()
                    break
                except psycopg.OperationalError as exc:
                    if time.monotonic() >= deadline:
                        raise PassageStoreError(f"passage store {self._where} unreachable: {str(exc).strip()}") from exc
                    logger.warning("passage store %s unreachable (%s); retrying", self._where, str(exc).strip())
                    time.sleep(1.0)

    # ------------------------------------------------------------------ connection
    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                logger.warning("connection to %s lost; reconnecting", self._where)
            self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=self._timeout,
                                         application_name="blendserve")
        return self._conn

    def describe(self) -> str:
        return self._where

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and not self._conn.closed:
                self._conn.close()
            if self._listener is not None and not self._listener.closed:
                self._listener.close()

    # ------------------------------------------------------------------ notifications
    def _announce(self, ex) -> None:
        ex(f"NOTIFY {CHANNEL}")

    def wait_for_change(self, timeout: float) -> bool | None:
        """LISTEN on a connection of its own: True as soon as a write that logged changes commits,
        False after `timeout`. If listening fails (PostgreSQL away) it waits out `timeout` and the
        caller polls as without notifications."""
        try:
            if self._listener is None or self._listener.closed or self._listener.broken:
                self._listener = psycopg.connect(self.url, autocommit=True, connect_timeout=self._timeout,
                                                 application_name="blendserve-sync")
                self._listener.execute(f"LISTEN {CHANNEL}")
            woken = False
            for _ in self._listener.notifies(timeout=timeout, stop_after=1):
                woken = True
            return woken
        except psycopg.Error as exc:
            logger.debug("LISTEN on %s failed (%s); polling", self._where, exc)
            if self._listener is not None and not self._listener.closed:
                self._listener.close()
            time.sleep(timeout)
            return False

    # ------------------------------------------------------------------ schema
    def schema_version(self) -> int:
        with self._lock:
            run = _PgRunner(self._connection())
            if run("SELECT to_regclass('store_meta')")[0][0] is None:
                return 1 if run("SELECT to_regclass('passages')")[0][0] is not None else 0
            row = run("SELECT value FROM store_meta WHERE key = 'schema_version'")
            return int(row[0][0]) if row else 0

    def _migrate(self) -> None:
        conn = self._connection()
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            found = self.schema_version()
            if found > SCHEMA_VERSION:
                raise SchemaTooNew(found, where=self._where)
            if found == SCHEMA_VERSION:
                return
            for stmt in schema("postgresql"):
                conn.execute(stmt)
            conn.execute(f"ALTER TABLE passages ADD COLUMN IF NOT EXISTS {embedding_column('postgresql')}")
            for _, _, stmt in added_columns("postgresql"):
                conn.execute(stmt.replace("ADD COLUMN", "ADD COLUMN IF NOT EXISTS", 1))
            for stmt in (*search_rebuild("postgresql", found), *search_schema("postgresql")):
                # the generated column indexes existing rows as it is added
                conn.execute(stmt)
            conn.execute("INSERT INTO store_meta (key, value) VALUES ('schema_version', %s) "
                         "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))
        logger.info("passage store %s: schema version %d (was %d)", self._where, SCHEMA_VERSION, found)

    def lexical_search(self, terms: Sequence[str], k: int, filters: Filters = NO_FILTERS,
                       title_weight: float = 1.0) -> list[tuple[int, float]]:
        """Full-text search on the generated `search` column (GIN index), any of the terms, ranked by ts_rank.
        The terms are letters and digits only (`lexical.query_terms`), so `|` between them is the only operator."""
        if not terms or k <= 0:
            return []
        where, args = filters.sql()
        rows = self._fetch(f"SELECT p.vec_id, {_RANK} AS score FROM passages p, "
                           f"to_tsquery('{TEXT_SEARCH_CONFIG}', ?) q WHERE p.search @@ q AND {where} "
                           "ORDER BY score DESC, p.vec_id LIMIT ?",
                           (*_weights(title_weight), " | ".join(terms), *args, int(k)))
        return [(int(v), float(score)) for v, score in rows]

    def lexical_scores(self, terms: Sequence[str], vec_ids: Sequence[int],
                       title_weight: float = 1.0) -> dict[int, float]:
        out = dict.fromkeys((int(v) for v in vec_ids), 0.0)
        if not terms or not out:
            return out
        rows = self._fetch(f"SELECT p.vec_id, {_RANK} FROM passages p, to_tsquery('{TEXT_SEARCH_CONFIG}', ?) q "
                           "WHERE p.vec_id = ANY(?) AND p.search @@ q",
                           (*_weights(title_weight), " | ".join(terms), list(out)))
        out.update((int(v), float(score)) for v, score in rows)
        return out

    # ------------------------------------------------------------------ statements
    def _fetch(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        """One read; a broken connection is replaced and the read tried once more (reads only)."""
        with self._lock:
            for attempt in (0, 1):
                try:
                    return _PgRunner(self._connection())(sql, args)
                except psycopg.OperationalError as exc:
                    alive = self._conn is not None and not self._conn.closed and not self._conn.broken
                    if attempt or alive:
                        raise PassageStoreError(f"passage store {self._where} failed: {str(exc).strip()}") from exc
            raise AssertionError("unreachable")

    @contextmanager
    def _write(self) -> Iterator[_PgRunner]:
        with self._lock:
            try:
                conn = self._connection()
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
                    yield _PgRunner(conn)
            except psycopg.IntegrityError as exc:
                raise PassageConflict(str(exc).strip()) from exc
            except psycopg.OperationalError as exc:  # disk full, connection lost mid-write: name the cause
                raise PassageStoreError(f"passage store write failed: {str(exc).strip()}") from exc
