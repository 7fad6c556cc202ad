"""What every passage store holds and offers: the row types, the errors, and `PassageStore`, the
interface with the SQL both backends share (`?` placeholders; the table text is in
`retrieval.schema`). The backends: `retrieval.passages_sqlite.PassageDB` and
`retrieval.passages_pg.PgPassageStore`; `retrieval.passages` says how they fit together.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from retrieval.lexical import NO_FILTERS, Filters
from retrieval.schema import ROW_COLUMNS, SCHEMA_VERSION

_SELECT = ", ".join(ROW_COLUMNS)  # a PassageRow's columns, in field order


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
    location: str = ""  # its page ("page 3") or heading path ("Guide > Install"); "" when none


@dataclass(frozen=True)
class Change:
    """One change-log entry: `op` is "add" (passage inserted) or "del" (passage deleted)."""
    seq: int
    op: str
    vec_id: int
    passage_id: str
    doc_id: str
    at: float  # the store's clock, seconds since the epoch


@dataclass(frozen=True)
class StoreHead:
    """The newest change sequence number (0 when the log is empty) and the store's clock now."""
    seq: int
    now: float


class PassageStoreError(RuntimeError):
    """The passage store could not be written (disk full, I/O error): a storage fault, naming its cause."""


class PassageConflict(RuntimeError):
    """A write broke a uniqueness rule (a vec_id owned by another passage); nothing was written."""


class SchemaTooNew(RuntimeError):
    """The store was written by a newer Blendserve: refuse to start rather than misread it."""

    def __init__(self, found: int, supported: int = SCHEMA_VERSION, where: str = "") -> None:
        super().__init__(f"passage store{' ' + where if where else ''} has schema version {found}, newer than "
                         f"this build supports ({supported}); upgrade Blendserve on this replica (or point it at "
                         f"another store)")
        self.found = found
        self.supported = supported


def vector_bytes(vec: np.ndarray) -> bytes:
    return np.ascontiguousarray(vec, dtype="<f4").tobytes()


def vector_from(data: bytes | memoryview | None) -> np.ndarray | None:
    return None if data is None else np.frombuffer(bytes(data), dtype="<f4").copy()


class PassageStore(ABC):
    """What ingestion, retrieval and index sync need from a passage store. Thread-safe.

    Subclasses provide a transaction (`_write`) and one-statement reads (`_fetch`) with `?`
    placeholders; the SQL below is common to SQLite and PostgreSQL."""

    backend = "abstract"
    _NOW = ""  # SQL for the store's clock in seconds since the epoch (change-log times, lag)

    # ------------------------------------------------------------------ backend hooks
    @abstractmethod
    def _fetch(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        """Run one read statement; all rows as tuples."""

    @abstractmethod
    @contextmanager
    def _write(self) -> Iterator[Any]:
        """A serialized write transaction; yields `ex(sql, args)` / `ex.many(sql, seq)` runner."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def schema_version(self) -> int: ...

    @abstractmethod
    def lexical_search(self, terms: Sequence[str], k: int, filters: Filters = NO_FILTERS,
                       title_weight: float = 1.0) -> list[tuple[int, float]]:
        """The k passages best matching any of `terms` (full-text search in the store): (vec_id, score),
        best first, higher is better; [] when there are no terms. A word matched in a passage's title
        counts `title_weight` times one matched in its text."""

    @abstractmethod
    def lexical_scores(self, terms: Sequence[str], vec_ids: Sequence[int],
                       title_weight: float = 1.0) -> dict[int, float]:
        """The `lexical_search` score of each of `vec_ids` (0.0 where its passage matches none of the terms or
        is absent), so a fusion can score a dense hit the lexical search did not return."""

    def describe(self) -> str:
        """Where the store lives, without credentials (for logs and /readyz)."""
        return self.backend

    # ------------------------------------------------------------------ writes (one transaction each)
    def upsert(self, rows: Sequence[PassageRow], vectors: Mapping[int, np.ndarray] | None = None) -> list[str]:
        """Insert or update rows (by id) in one transaction: all of them are stored, or none.

        `vectors` maps vec_id -> embedding [dim] (stored with the row). Each row inserted (not
        updated) gets an `add` change. Returns the ids inserted. A vec_id owned by another
        passage is an integrity error, never a silent replace."""
        if not rows:
            return []
        with self._write() as ex:
            return self._upsert_in(ex, rows, vectors or {})

    def _upsert_in(self, ex, rows: Sequence[PassageRow], vectors: Mapping[int, np.ndarray | None]) -> list[str]:
        now = time.time()
        present = self._ids_present(ex, [r.id for r in rows])
        new = [r for r in rows if r.id not in present]
        old = [r for r in rows if r.id in present]
        if new:
            ex.many(_insert("passages"), [self._insert_values(r, now, vectors) for r in new])
            self._log(ex, "add", new)
        if old:
            sets = ", ".join(f"{c} = ?" for c in ROW_COLUMNS[1:])
            ex.many(f"UPDATE passages SET {sets}, embedding = COALESCE(?, embedding) WHERE id = ?",
                    [self._values(r, now)[1:] + (self._blob(vectors.get(r.vec_id)), r.id) for r in old])
        return [r.id for r in new]

    # ------------------------------------------------------------------ staging: documents visible whole
    def stage(self, rows: Sequence[PassageRow], vectors: Mapping[int, np.ndarray] | None = None) -> None:
        """Write rows of documents being ingested, invisible until `publish` (one transaction, no change entry)."""
        if not rows:
            return
        vectors = vectors or {}
        now = time.time()
        with self._write() as ex:
            ex.many("DELETE FROM staged WHERE id = ?", [(r.id,) for r in rows])
            ex.many(_insert("staged"), [self._insert_values(r, now, vectors) for r in rows])

    def publish(self, doc_ids: Sequence[str], keep: Mapping[str, set[str]] | None = None
                ) -> tuple[list[PassageRow], list[PassageRow]]:
        """Make the staged version of each document the visible one, all in one transaction.

        Passages of a document's previous version that the new one lacks are removed, except the ids
        in `keep[doc_id]` (passages the same ingestion published earlier). Documents with nothing
        staged are left alone. Returns (removed rows, published rows)."""
        keep = keep or {}
        removed: list[PassageRow] = []
        published: list[PassageRow] = []
        with self._write() as ex:
            for doc_id in dict.fromkeys(doc_ids):
                found = ex(f"SELECT {_SELECT}, embedding FROM staged WHERE doc_id = ? ORDER BY seq", (doc_id,))
                if not found:
                    continue
                rows = [_row(r) for r in found]
                stay = {r.id for r in rows} | set(keep.get(doc_id, ()))
                gone = [_row(r) for r in ex(f"SELECT {_SELECT} FROM passages WHERE doc_id = ?", (doc_id,))
                        if r[0] not in stay]
                if gone:
                    ex.many("DELETE FROM passages WHERE id = ?", [(r.id,) for r in gone])
                    self._log(ex, "del", gone)
                self._upsert_in(ex, rows, {r.vec_id: vector_from(f[len(ROW_COLUMNS)]) for r, f in zip(rows, found)})
                ex("DELETE FROM staged WHERE doc_id = ?", (doc_id,))
                removed += gone
                published += rows
        return removed, published

    def discard(self, doc_ids: Sequence[str]) -> int:
        """Drop staged rows of these documents (an ingestion that was cancelled or is abandoned)."""
        doc_ids = list(dict.fromkeys(doc_ids))
        if not doc_ids:
            return 0
        with self._write() as ex:
            n = sum(int(ex("SELECT COUNT(*) FROM staged WHERE doc_id = ?", (d,))[0][0]) for d in doc_ids)
            ex.many("DELETE FROM staged WHERE doc_id = ?", [(d,) for d in doc_ids])
        return n

    def incomplete(self) -> dict[str, int]:
        """Documents with staged rows left by an ingestion that did not finish: {doc_id: staged passages}."""
        return {r[0]: int(r[1]) for r in self._fetch("SELECT doc_id, COUNT(*) FROM staged GROUP BY doc_id ORDER BY doc_id")}

    def _log(self, ex, op: str, rows: Sequence[PassageRow]) -> None:
        """Change-log entries for `rows`, inside the caller's write transaction (store clock)."""
        ex.many(f"INSERT INTO passage_changes (op, vec_id, passage_id, doc_id, at) VALUES (?, ?, ?, ?, {self._NOW})",
                [(op, r.vec_id, r.id, r.doc_id) for r in rows])
        if rows:
            self._announce(ex)

    def _announce(self, ex) -> None:
        """Tell followers the log grew (delivered at commit). PostgreSQL: NOTIFY; SQLite: nothing."""
        return None

    def wait_for_change(self, timeout: float) -> bool | None:
        """Block until the change log may have grown (True) or `timeout` seconds pass (False).
        None, at once, when the backend has no notifications (SQLite): followers just poll."""
        return None

    def _ids_present(self, ex, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for part in _parts(list(ids)):
            found.update(r[0] for r in ex(f"SELECT id FROM passages WHERE id IN ({_marks(part)})", part))
        return found

    @staticmethod
    def _values(r: PassageRow, now: float) -> tuple:
        return tuple((r.ingested_at or now) if c == "ingested_at" else getattr(r, c) for c in ROW_COLUMNS)

    def _insert_values(self, r: PassageRow, now: float, vectors: Mapping[int, np.ndarray | None]) -> tuple:
        return self._values(r, now) + (self._blob(vectors.get(r.vec_id)),)

    def _blob(self, vec: np.ndarray | None) -> Any:
        return None if vec is None else vector_bytes(vec)

    def set_kv(self, passage_id: str, kv_key: str, token_count: int) -> None:
        with self._write() as ex:
            ex("UPDATE passages SET kv_key = ?, token_count = ? WHERE id = ?", (kv_key, token_count, passage_id))

    def set_vectors(self, vectors: Mapping[int, np.ndarray]) -> None:
        """Store embeddings of rows that lack one (rows from schema version 1); no change entry."""
        if not vectors:
            return
        with self._write() as ex:
            ex.many("UPDATE passages SET embedding = ? WHERE vec_id = ?",
                    [(self._blob(v), int(k)) for k, v in vectors.items()])

    def delete_document(self, doc_id: str) -> list[PassageRow]:
        """Remove a document's passages in one transaction (a `del` change each); the removed rows."""
        with self._write() as ex:
            rows = [_row(r) for r in ex(f"SELECT {_SELECT} FROM passages WHERE doc_id = ? ORDER BY seq", (doc_id,))]
            if rows:
                ex("DELETE FROM passages WHERE doc_id = ?", (doc_id,))
                self._log(ex, "del", rows)
            ex("DELETE FROM staged WHERE doc_id = ?", (doc_id,))
        return rows

    # ------------------------------------------------------------------ reads
    def _rows(self, sql: str, args: Iterable = ()) -> list[PassageRow]:
        return [_row(r) for r in self._fetch(sql, tuple(args))]

    def get_many(self, ids: Sequence[str]) -> dict[str, PassageRow]:
        out: dict[str, PassageRow] = {}
        for part in _parts(list(ids)):
            out.update((r.id, r) for r in self._rows(f"SELECT {_SELECT} FROM passages WHERE id IN ({_marks(part)})",
                                                     part))
        return out

    def by_vec_ids(self, vec_ids: Sequence[int]) -> dict[int, PassageRow]:
        out: dict[int, PassageRow] = {}
        for part in _parts([int(v) for v in vec_ids]):
            q = f"SELECT {_SELECT} FROM passages WHERE vec_id IN ({_marks(part)})"
            out.update((r.vec_id, r) for r in self._rows(q, part))
        return out

    def vectors(self, vec_ids: Sequence[int]) -> dict[int, np.ndarray | None]:
        """Stored embeddings of present passages (None where a row has none); absent ids are left out."""
        out: dict[int, np.ndarray | None] = {}
        for part in _parts([int(v) for v in vec_ids]):
            for vid, blob in self._fetch(f"SELECT vec_id, embedding FROM passages WHERE vec_id IN ({_marks(part)})",
                                         part):
                out[int(vid)] = vector_from(blob)
        return out

    def matching(self, vec_ids: Sequence[int], filters: Filters) -> set[int]:
        """The vec_ids among `vec_ids` whose passages pass the filters."""
        where, args = filters.sql()
        out: set[int] = set()
        for part in _parts([int(v) for v in vec_ids]):
            out.update(int(r[0]) for r in self._fetch(
                f"SELECT p.vec_id FROM passages p WHERE p.vec_id IN ({_marks(part)}) AND {where}", (*part, *args)))
        return out

    def filtered_vectors(self, filters: Filters, limit: int) -> dict[int, np.ndarray]:
        """Stored embeddings of the passages that pass the filters (at most `limit`), for an exact
        dense search among them; rows without an embedding are left out."""
        where, args = filters.sql()
        rows = self._fetch(f"SELECT p.vec_id, p.embedding FROM passages p WHERE {where} AND p.embedding IS NOT NULL "
                           "ORDER BY p.vec_id LIMIT ?", (*args, int(limit)))
        return {int(v): vector_from(blob) for v, blob in rows}

    def document(self, doc_id: str) -> list[PassageRow]:
        return self._rows(f"SELECT {_SELECT} FROM passages WHERE doc_id = ? ORDER BY seq", (doc_id,))

    def all_rows(self) -> list[PassageRow]:
        return self._rows(f"SELECT {_SELECT} FROM passages ORDER BY doc_id, seq")

    def vec_ids(self) -> set[int]:
        return {int(r[0]) for r in self._fetch("SELECT vec_id FROM passages")}

    def kv_keys(self) -> set[str]:
        """KV keys referenced by a passage, visible or staged."""
        return {r[0] for r in self._fetch("SELECT kv_key FROM passages UNION SELECT kv_key FROM staged")}

    def key_in_use(self, kv_key: str) -> bool:
        return bool(self._fetch("SELECT 1 FROM passages WHERE kv_key = ? UNION ALL SELECT 1 FROM staged WHERE "
                                "kv_key = ?", (kv_key, kv_key)))

    def counts(self) -> dict:
        r = self._fetch(
            "SELECT COUNT(*), COUNT(DISTINCT doc_id), COALESCE(SUM(token_count), 0), COUNT(DISTINCT kv_key), "
            "MIN(ingested_at), MAX(ingested_at) FROM passages"
        )[0]
        return {"passages": int(r[0]), "documents": int(r[1]), "tokens": int(r[2]), "kv_keys": int(r[3]),
                "first_ingested_at": r[4], "last_ingested_at": r[5]}

    # ------------------------------------------------------------------ change log
    def head(self) -> StoreHead:
        seq, now = self._fetch(f"SELECT COALESCE(MAX(seq), 0), {self._NOW} FROM passage_changes")[0]
        return StoreHead(int(seq), float(now))

    def changes_since(self, seq: int, limit: int = 1000) -> list[Change]:
        """Change-log entries after `seq`, oldest first, at most `limit`."""
        q = "SELECT seq, op, vec_id, passage_id, doc_id, at FROM passage_changes WHERE seq > ? ORDER BY seq LIMIT ?"
        return [Change(int(s), op, int(v), pid, did, float(at)) for s, op, v, pid, did, at in self._fetch(q, (seq, limit))]


def _row(r: Sequence[Any]) -> PassageRow:
    return PassageRow(*r[:len(ROW_COLUMNS)])


def _insert(table: str) -> str:
    """A row and its embedding into `passages` or `staged` (the same columns)."""
    return f"INSERT INTO {table} ({_SELECT}, embedding) VALUES ({_marks((*ROW_COLUMNS, 'embedding'))})"


def _marks(part: Sequence[Any]) -> str:
    return ", ".join("?" * len(part))


def _parts(items: list, size: int = 500) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
