"""The passage store's tables, defined once and rendered for SQLite and for PostgreSQL.

Schema version 6 (1: passages only, no meta table; 2: + embedding column, change log,
store_meta; 3: + staged; 4: + lexical search of `passages`, `search_schema`; 5: + `location`, a
passage's page or heading path, on `passages` and `staged`, `ADDED_COLUMNS`; 6: PostgreSQL's search
column weights title words A and text words B, so a title match can count more, `SEARCH_REBUILD`):

- `passages`: one row per visible passage; `vec_id` is its FAISS id, `embedding` its vector;
- `staged`: the same columns, rows of documents being ingested (never read by retrieval; a
  document's vec_ids may repeat while it is re-ingested, so `vec_id` is not unique there);
- `passage_changes`: the ingestion change log, numbered in commit order;
- `store_meta`: key/value, holds `schema_version`;
- lexical search (version 4): SQLite, an FTS5 table `passages_fts` over `passages` (external content,
  its rowid the passage's `vec_id`, kept current by triggers, backfilled by `rebuild` on migration);
  PostgreSQL, a generated `search` tsvector column with a GIN index (filled by PostgreSQL for
  existing rows when the column is added; since version 6 the title's words weighted A, the text's B).

A column names a kind (`text`, `int`, `id64`, `float`, `bytes`, `serial`); `TYPES` gives each
kind's type in each dialect, so both stores create the same tables. The rendered text is the
text the stores executed before the schema was defined here (checked by a test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCHEMA_VERSION = 6

Dialect = Literal["sqlite", "postgresql"]

# kind -> (SQLite, PostgreSQL)
TYPES: dict[str, tuple[str, str]] = {
    "text": ("TEXT", "TEXT"),
    "int": ("INTEGER", "INTEGER"),
    "id64": ("INTEGER", "BIGINT"),  # FAISS ids: 60 bits
    "float": ("REAL", "DOUBLE PRECISION"),
    "bytes": ("BLOB", "BYTEA"),
    "serial": ("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY"),  # numbered in commit order
}
NOT_NULL = "NOT NULL"


@dataclass(frozen=True)
class Column:
    name: str
    kind: str
    rule: str = ""  # constraints after the type, the same in both dialects

    def sql(self, dialect: Dialect, width: int = 0) -> str:
        """`name TYPE rule`, the name padded to `width` characters."""
        kind = TYPES[self.kind][dialect == "postgresql"]
        return " ".join(part for part in (self.name.ljust(width), kind, self.rule) if part)


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    indexes: tuple[tuple[str, str], ...] = ()  # (index name, column)
    one_line: bool = False  # a short table is written on one line

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)

    def create(self, dialect: Dialect) -> str:
        if self.one_line:
            return f"CREATE TABLE IF NOT EXISTS {self.name} ({', '.join(c.sql(dialect) for c in self.columns)})"
        width = max(len(c.name) for c in self.columns)
        body = ",\n".join(f"    {c.sql(dialect, width)}" for c in self.columns)
        return f"CREATE TABLE IF NOT EXISTS {self.name} (\n{body}\n)"

    def statements(self, dialect: Dialect) -> tuple[str, ...]:
        indexes = tuple(f"CREATE INDEX IF NOT EXISTS {ix} ON {self.name}({col})" for ix, col in self.indexes)
        return (self.create(dialect), *indexes)


def _passage_table(name: str, vec_id_rule: str, indexes: tuple[tuple[str, str], ...]) -> Table:
    """`passages` and `staged`: one column list, so a row moves between them as is."""
    return Table(name, (
        Column("id", "text", "PRIMARY KEY"),
        Column("vec_id", "id64", vec_id_rule),
        Column("doc_id", "text", NOT_NULL),
        Column("seq", "int", NOT_NULL),
        Column("title", "text", NOT_NULL),
        Column("text", "text", NOT_NULL),
        Column("source", "text", NOT_NULL),
        Column("token_count", "int", NOT_NULL),
        Column("kv_key", "text", NOT_NULL),
        Column("ingested_at", "float", NOT_NULL),
        Column("embedding", "bytes"),
    ), indexes)


PASSAGES = _passage_table("passages", "NOT NULL UNIQUE", (("passages_doc", "doc_id"), ("passages_kv", "kv_key")))
STAGED = _passage_table("staged", NOT_NULL, (("staged_doc", "doc_id"),))
CHANGES = Table("passage_changes", (
    Column("seq", "serial"),
    Column("op", "text", "NOT NULL CHECK (op IN ('add', 'del'))"),
    Column("vec_id", "id64", NOT_NULL),
    Column("passage_id", "text", NOT_NULL),
    Column("doc_id", "text", NOT_NULL),
    Column("at", "float", NOT_NULL),
))
META = Table("store_meta", (Column("key", "text", "PRIMARY KEY"), Column("value", "text", NOT_NULL)), one_line=True)
TABLES = (PASSAGES, CHANGES, META, STAGED)  # creation order

# Columns added after version 3, to both passage tables, by `ALTER TABLE ... ADD COLUMN` (new and old stores alike).
LOCATION = Column("location", "text", "NOT NULL DEFAULT ''")  # version 5: "page 3" or "Guide > Install"
ADDED_COLUMNS = (LOCATION,)

# A passage row's columns (`PassageRow`'s fields, in order): every column but the embedding.
ROW_COLUMNS = (*(n for n in PASSAGES.names if n != "embedding"), *(c.name for c in ADDED_COLUMNS))


def schema(dialect: Dialect) -> tuple[str, ...]:
    """Every statement creating the current schema, in order (each `IF NOT EXISTS`)."""
    return tuple(stmt for table in TABLES for stmt in table.statements(dialect))


def embedding_column(dialect: Dialect) -> str:
    """`embedding <type>`: the column version 1 lacked (added by migration)."""
    return PASSAGES.column("embedding").sql(dialect)


# Version 4: lexical search in the store itself, so replicas agree and no second index needs syncing.
FTS_TABLE = "passages_fts"
TEXT_SEARCH_CONFIG = "english"  # PostgreSQL's stemming and stopwords; SQLite: the porter stemmer
_FTS_ROW = "(rowid, title, text) VALUES (new.vec_id, new.title, new.text)"
_FTS_DELETE = f"({FTS_TABLE}, rowid, title, text) VALUES ('delete', old.vec_id, old.title, old.text)"
SEARCH = {
    "sqlite": (
        f"CREATE VIRTUAL TABLE IF NOT EXISTS {FTS_TABLE} USING fts5(title, text, content='passages', "
        "content_rowid='vec_id', tokenize='porter unicode61 remove_diacritics 2')",
        f"CREATE TRIGGER IF NOT EXISTS passages_fts_insert AFTER INSERT ON passages BEGIN "
        f"INSERT INTO {FTS_TABLE}{_FTS_ROW}; END",
        f"CREATE TRIGGER IF NOT EXISTS passages_fts_delete AFTER DELETE ON passages BEGIN "
        f"INSERT INTO {FTS_TABLE}{_FTS_DELETE}; END",
        f"CREATE TRIGGER IF NOT EXISTS passages_fts_update AFTER UPDATE OF vec_id, title, text ON passages BEGIN "
        f"INSERT INTO {FTS_TABLE}{_FTS_DELETE}; INSERT INTO {FTS_TABLE}{_FTS_ROW}; END",
    ),
    "postgresql": (
        "ALTER TABLE passages ADD COLUMN IF NOT EXISTS search tsvector GENERATED ALWAYS AS "
        f"(setweight(to_tsvector('{TEXT_SEARCH_CONFIG}'::regconfig, title), 'A') || "
        f"setweight(to_tsvector('{TEXT_SEARCH_CONFIG}'::regconfig, text), 'B')) STORED",
        "CREATE INDEX IF NOT EXISTS passages_search ON passages USING GIN (search)",
    ),
}
# SQLite's FTS5 index of rows that were stored before it existed (a migration from version <= 3).
FTS_BACKFILL = f"INSERT INTO {FTS_TABLE}({FTS_TABLE}) VALUES ('rebuild')"
# Version 6: a PostgreSQL store of version 4 or 5 drops its unweighted search column (and its index with it)
# before `search_schema` adds the weighted one. SQLite's FTS5 table keeps title and text apart already.
SEARCH_REBUILD = {"sqlite": (), "postgresql": ("ALTER TABLE passages DROP COLUMN IF EXISTS search",)}


def added_columns(dialect: Dialect) -> tuple[tuple[str, str, str], ...]:
    """(table, column name, `ALTER TABLE ... ADD COLUMN ...`) for each column added since version 3."""
    return tuple((t.name, c.name, f"ALTER TABLE {t.name} ADD COLUMN {c.sql(dialect)}")
                 for t in (PASSAGES, STAGED) for c in ADDED_COLUMNS)


def search_rebuild(dialect: Dialect, found: int) -> tuple[str, ...]:
    """The statements a store of schema version `found` runs before `search_schema` (version 6's rebuild)."""
    return SEARCH_REBUILD[dialect] if 4 <= found < 6 else ()


def search_schema(dialect: Dialect) -> tuple[str, ...]:
    """The statements adding lexical search (version 4) to the tables of `schema(dialect)`; each if absent."""
    return SEARCH[dialect]
