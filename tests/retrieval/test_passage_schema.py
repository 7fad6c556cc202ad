"""The passage store's schema, defined once (`retrieval.schema`), creates exactly the tables of
schema version 3 in both dialects (the statements are the text the stores executed before), plus
version 4's lexical search (`search_schema`); a fresh store and a version-3 store migrated in place
end up with the same database (sqlite_master; PostgreSQL's catalog)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import uuid
from pathlib import Path

import psycopg
import pytest

from retrieval.passages import SCHEMA_VERSION, PassageDB, PassageRow
from retrieval.schema import (
    ADDED_COLUMNS,
    PASSAGES,
    ROW_COLUMNS,
    STAGED,
    added_columns,
    embedding_column,
    schema,
    search_schema,
)

# Schema version 3 as the two stores executed it before the one definition (frozen reference data).
V3 = json.loads((Path(__file__).parent / "schema_v3.json").read_text())


def _words(sql: str) -> str:
    return " ".join(sql.split())


def test_each_dialect_renders_the_version_3_text():
    assert SCHEMA_VERSION == 6  # 3's tables + search_schema (4) + added_columns (5) + weighted search (6)
    assert list(schema("sqlite")) == [s.strip() for s in V3["sqlite"]]
    assert [_words(s) for s in schema("postgresql")] == [_words(s) for s in V3["postgresql"]]
    assert [f"ALTER TABLE passages ADD COLUMN {embedding_column('sqlite')}"] == V3["sqlite_migration"]
    assert [f"ALTER TABLE passages ADD COLUMN IF NOT EXISTS {embedding_column('postgresql')}"] == \
        V3["postgresql_migration"]


def test_one_column_list_for_rows_passages_and_staged():
    assert ROW_COLUMNS == tuple(f.name for f in dataclasses.fields(PassageRow))
    added = tuple(c.name for c in ADDED_COLUMNS)
    assert ROW_COLUMNS[-len(added):] == added == ("location",)
    assert PASSAGES.names == STAGED.names == (*ROW_COLUMNS[:-len(added)], "embedding")


def _sqlite_master(path) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name").fetchall()


def test_sqlite_creates_the_version_3_schema_plus_search(tmp_path):
    before = tmp_path / "before.sqlite3"
    with sqlite3.connect(before) as conn:
        for stmt in V3["sqlite"]:  # as PassageDB ran it
            conn.execute(stmt)
        conn.execute("INSERT INTO store_meta (key, value) VALUES ('schema_version', '3')")
    PassageDB(before).close()  # migrated in place
    PassageDB(tmp_path / "now.sqlite3").close()
    master = _sqlite_master(tmp_path / "now.sqlite3")
    assert {name for _, name, _, _ in master} >= {"passages", "staged", "passage_changes", "store_meta", "passages_fts"}
    assert master == _sqlite_master(before)


CATALOG = (
    "SELECT table_name, column_name, ordinal_position, data_type, is_nullable, column_default "
    "FROM information_schema.columns WHERE table_schema = 'public' ORDER BY table_name, ordinal_position",
    "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY indexname",
    "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
    "WHERE connamespace = 'public'::regnamespace ORDER BY conname",
    "SELECT sequencename, data_type FROM pg_sequences WHERE schemaname = 'public' ORDER BY sequencename",
)


def _catalog(url: str) -> list[list[tuple]]:
    with psycopg.connect(url) as conn:
        return [conn.execute(q).fetchall() for q in CATALOG]


def test_postgresql_creates_the_version_3_schema_plus_search(pg_cluster):
    from retrieval.passages_pg import PgPassageStore

    before = pg_cluster.create_database(f"v3{uuid.uuid4().hex[:10]}")
    with psycopg.connect(before, autocommit=True) as conn:
        for stmt in (*V3["postgresql"], *V3["postgresql_migration"], *(a[2] for a in added_columns("postgresql")),
                     *search_schema("postgresql")):
            conn.execute(stmt)  # as PgPassageStore ran them (version 3), then versions 4 and 5's additions
    now = pg_cluster.create_database(f"v3{uuid.uuid4().hex[:10]}")
    PgPassageStore(now).close()
    catalog = _catalog(now)
    # passages (+ location, its generated search column), staged (+ location), passage_changes, store_meta
    assert len(catalog[0]) == 2 * (len(PASSAGES.columns) + len(ADDED_COLUMNS)) + 1 + 6 + 2
    assert catalog == _catalog(before)


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_every_statement_creates_if_absent(dialect):
    assert all(s.startswith(("CREATE TABLE IF NOT EXISTS ", "CREATE INDEX IF NOT EXISTS ")) for s in schema(dialect))
    assert all(s.startswith(("CREATE VIRTUAL TABLE IF NOT EXISTS ", "CREATE TRIGGER IF NOT EXISTS ",
                             "CREATE INDEX IF NOT EXISTS ", "ALTER TABLE passages ADD COLUMN IF NOT EXISTS "))
               for s in search_schema(dialect))
