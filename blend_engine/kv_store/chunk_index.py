"""The disk tier's index: `index.sqlite` beside the chunk files keeps each chunk's size and last
use across restarts. The files are the truth: the store reconciles the index with them on
start-up, a failed update is logged and counted but never fails a read or a write, and an index
that is not a readable database is moved aside and rebuilt from the files.
"""

from __future__ import annotations

import logging
import sqlite3
import time
import uuid
from pathlib import Path

from blend_engine.kv_store.base import StoreStats

logger = logging.getLogger(__name__)


class ChunkIndex:
    def __init__(self, path: Path, stats: StoreStats, attempts: int = 50) -> None:
        self.path = Path(path)
        self._stats = stats  # errors and corrupt are counted in the tier's stats
        self._db = self.open(attempts)

    def open(self, attempts: int = 50) -> sqlite3.Connection:
        """A connection to the index. Switching to WAL while another process opens the same file can
        fail with "database is locked" at once (SQLite skips its busy handler there), so set-up
        retries. An index that is not a readable database is moved aside and rebuilt."""
        try:
            return self._connect(attempts)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise
            self._quarantine(exc)
            return self._connect(attempts)

    def _connect(self, attempts: int) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
        attempt = 1
        while True:
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, nbytes INTEGER, last_used REAL)")
                db.execute("SELECT COUNT(*) FROM entries").fetchone()  # a damaged file fails here at the latest
                return db
            except sqlite3.DatabaseError as exc:
                if not isinstance(exc, sqlite3.OperationalError) or "locked" not in str(exc) or attempt >= attempts:
                    db.close()
                    raise
                time.sleep(0.02 * attempt)
                attempt += 1

    def _quarantine(self, exc: Exception) -> None:
        """Move a corrupt index (and its WAL files) aside; the chunk files are the truth and rebuild it."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{uuid.uuid4().hex[:6]}")
        self.path.replace(aside)
        for suffix in ("-wal", "-shm"):
            self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)
        self._stats.corrupt += 1
        logger.warning("disk store index %s is corrupt (%s); moved aside to %s and rebuilt from the chunk files",
                       self.path, exc, aside.name)

    def _sql(self, query: str, args: tuple = ()) -> list:
        try:
            return self._db.execute(query, args).fetchall()
        except sqlite3.Error as exc:  # the files stay the truth; the index is rebuilt on start-up
            self._stats.errors += 1
            logger.warning("disk store index update failed (%s); continuing", exc)
            return []

    def rows(self) -> dict[str, tuple[int, float]]:
        """key -> (nbytes, last used)."""
        return {k: (n, t) for k, n, t in self._sql("SELECT key, nbytes, last_used FROM entries")}

    def put(self, key: str, nbytes: int, last_used: float | None = None) -> None:
        self._sql("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)",
                  (key, nbytes, time.time() if last_used is None else last_used))

    def touch(self, key: str) -> None:
        self._sql("UPDATE entries SET last_used = ? WHERE key = ?", (time.time(), key))

    def delete(self, key: str) -> None:
        self._sql("DELETE FROM entries WHERE key = ?", (key,))

    def close(self) -> None:
        self._db.close()
