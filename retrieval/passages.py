"""Passage store: the source of truth for what is ingested, behind one interface, two backends.

- `PassageDB` (`retrieval.passages_sqlite`): SQLite (standard library), the embedded default, one
  file in the data dir.
- `retrieval.passages_pg.PgPassageStore`: PostgreSQL (psycopg 3), shared by every replica
  (`BLENDSERVE_STORE_DATABASE_URL=postgresql://...`).
- `PassageStore` (`retrieval.passage_store`): the interface and the SQL both share; the tables are
  defined once in `retrieval.schema` and rendered for each dialect.

This module is the entry point: it re-exports the types and picks a backend (`open_passage_store`).

Both hold the same tables (schema version 3): `passages` (one row per passage: id
(content-derived), vector id (its FAISS id), document id, position in the document, title, text,
source, token count, KV key, ingestion time and its embedding), `passage_changes` (the ingestion change log: one `add` per
passage inserted, one `del` per passage deleted, numbered in commit order) and `store_meta`
(the schema version). Every FAISS index follows the change log (`retrieval.sync.IndexSync`).

Documents become visible whole: ingestion writes a document's passages to `staged` (the same
columns, never read by retrieval), then `publish` moves them into `passages` in one transaction,
removing the passages of the document's previous version (`del` and `add` changes logged as
for any write). Staged rows left by a crash mark the document incomplete (`incomplete()`) until
a re-run publishes them or `discard` drops them.

Writes are serialized (SQLite: BEGIN IMMEDIATE; PostgreSQL: a transaction-scoped advisory lock
taken before the first log entry), so change sequence numbers are handed out in commit order and a
follower that has applied every change up to N never sees a later commit with a number <= N.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from retrieval.passage_store import (
    Change,
    PassageConflict,
    PassageRow,
    PassageStore,
    PassageStoreError,
    SchemaTooNew,
    StoreHead,
    vector_bytes,
    vector_from,
)
from retrieval.passages_sqlite import PassageDB
from retrieval.schema import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "Change", "PassageConflict", "PassageDB", "PassageRow", "PassageStore",
           "PassageStoreError", "SchemaTooNew", "StoreHead", "open_passage_store", "passage_id", "vec_id_of",
           "vector_bytes", "vector_from"]


def open_passage_store(database_url: str | None, data_dir: Path, sqlite_file: str = "passages.sqlite3") -> PassageStore:
    """PostgreSQL when `database_url` is set (postgresql://...), else SQLite in `data_dir`."""
    if database_url:
        from retrieval.passages_pg import PgPassageStore

        return PgPassageStore(database_url)
    return PassageDB(Path(data_dir) / sqlite_file)


def passage_id(doc_id: str, title: str, text: str) -> str:
    """Content-derived passage id: the same paragraph of the same document always gets the same id."""
    h = hashlib.sha256("\x1f".join((doc_id, title.strip(), text.strip())).encode())
    return h.hexdigest()[:32]


def vec_id_of(pid: str) -> int:
    """The passage's FAISS id: 60 bits of its (hex) id, so always a positive int64."""
    return int(pid[:15], 16)
