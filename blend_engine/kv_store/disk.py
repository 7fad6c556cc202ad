"""Local disk tier: one file per chunk, layer-major, per-layer CRC32, atomic writes, LRU budget.

File layout (little endian)::

    b"BLKV\\x01\\n\\0\\0" | u32 header length | header JSON (ChunkMeta + key) | zero pad to 4 KiB
    | layer 0 blob | layer 1 blob | ... (each `meta.layer_nbytes` long)

so layer i is one positioned read at `data_offset + i * layer_nbytes`. Files are written to a
temporary name in the same folder and renamed into place, so a reader (or a second writer of the
same key, even in another process) only ever sees a complete file. A crash mid-write leaves at
worst a stale temporary file (removed on start-up) or, without fsync, a damaged file, which the
checksums catch. The index (SQLite, `index.sqlite` next to the files) keeps sizes and last use
across restarts; on start-up it is reconciled with the files actually present.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from blend_engine.kv_store.base import StoreStats
from blend_engine.kv_store.blob import Blob, BlobStore
from blend_engine.kv_store.codec import ChunkMeta, checksum

logger = logging.getLogger(__name__)

MAGIC = b"BLKV\x01\n\x00\x00"
_LEN = struct.Struct("<I")
_ALIGN = 4096
_MAX_HEADER = 1 << 20
_STALE_TMP_S = 3600.0


@dataclass
class _DiskEntry:
    nbytes: int
    meta: ChunkMeta | None = None  # parsed lazily from the file header
    data_offset: int = 0


class Corrupt(Exception):
    """A stored file that cannot be trusted."""


def _data_offset(header_len: int) -> int:
    end = len(MAGIC) + _LEN.size + header_len
    return -(-end // _ALIGN) * _ALIGN


def encode_header(key: str, meta: ChunkMeta) -> bytes:
    head = json.dumps({"key": key, "meta": json.loads(meta.to_json())}, sort_keys=True).encode()
    prefix = MAGIC + _LEN.pack(len(head)) + head
    return prefix + b"\x00" * (_data_offset(len(head)) - len(prefix))


def read_header(fd: int, key: str) -> tuple[ChunkMeta, int]:
    """(meta, data offset) of an open chunk file; raises Corrupt."""
    first = os.pread(fd, len(MAGIC) + _LEN.size, 0)
    if len(first) < len(MAGIC) + _LEN.size or first[: len(MAGIC)] != MAGIC:
        raise Corrupt("bad magic or truncated header")
    (n,) = _LEN.unpack(first[len(MAGIC):])
    if n > _MAX_HEADER:
        raise Corrupt(f"header length {n} is implausible")
    raw = os.pread(fd, n, len(first))
    try:
        head = json.loads(raw)
        meta = ChunkMeta.from_json(json.dumps(head["meta"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise Corrupt(f"unreadable header: {exc}") from None
    if head.get("key") != key:
        raise Corrupt(f"file holds key {head.get('key')!r}")
    offset = _data_offset(n)
    if os.fstat(fd).st_size < offset + meta.nbytes:
        raise Corrupt("truncated file")
    return meta, offset


class DiskStore(BlobStore):
    def __init__(self, root: Path | str, budget_bytes: int = 20 << 30, kv_format: str = "fp16",
                 fingerprint: str = "", name: str = "disk") -> None:
        super().__init__(name, kv_format, fingerprint)
        self.root = Path(root)
        self._chunks = self.root / "chunks"
        self._chunks.mkdir(parents=True, exist_ok=True)
        self._budget = budget_bytes
        self._lock = threading.RLock()
        self._index: OrderedDict[str, _DiskEntry] = OrderedDict()
        self._stats = StoreStats(name=name, bytes_budget=budget_bytes, extra={"dir": str(self.root)})
        self._db = self._open_db()
        self._load_index()

    # ------------------------------------------------------------------ paths and index
    def path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad chunk key {key!r}")
        return self._chunks / key[:2] / f"{key}.kv"

    def _open_db(self, attempts: int = 50) -> sqlite3.Connection:
        """The index connection. Switching to WAL while another process opens the same file can fail
        with "database is locked" at once (SQLite skips its busy handler there), so set-up retries.
        An index that is not a readable database is moved aside and rebuilt from the chunk files."""
        try:
            return self._connect(attempts)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise
            self._quarantine_index(exc)
            return self._connect(attempts)

    def _connect(self, attempts: int) -> sqlite3.Connection:
        db = sqlite3.connect(self.root / "index.sqlite", check_same_thread=False, isolation_level=None, timeout=10)
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

    def _quarantine_index(self, exc: Exception) -> None:
        """Move a corrupt index (and its WAL files) aside; the chunk files are the truth and rebuild it."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        base = self.root / "index.sqlite"
        aside = base.with_name(f"index.sqlite.corrupt-{stamp}-{uuid.uuid4().hex[:6]}")
        base.replace(aside)
        for suffix in ("-wal", "-shm"):
            base.with_name(base.name + suffix).unlink(missing_ok=True)
        self._stats.corrupt += 1
        logger.warning("disk store index %s is corrupt (%s); moved aside to %s and rebuilt from the chunk files",
                       base, exc, aside.name)

    def _sql(self, query: str, args: tuple = ()) -> list:
        try:
            return self._db.execute(query, args).fetchall()
        except sqlite3.Error as exc:  # the files stay the truth; the index is rebuilt on start-up
            self._stats.errors += 1
            logger.warning("disk store index update failed (%s); continuing", exc)
            return []

    def _load_index(self) -> None:
        """Rows from the index, reconciled with the files present (both ways), oldest use first."""
        rows = {k: (n, t) for k, n, t in self._sql("SELECT key, nbytes, last_used FROM entries")}
        files: dict[str, tuple[int, float]] = {}
        now = time.time()
        for f in self._chunks.glob("*/*"):
            if f.suffix == ".kv":
                st = f.stat()
                files[f.stem] = (st.st_size, st.st_mtime)
            elif ".tmp" in f.name and now - f.stat().st_mtime > _STALE_TMP_S:
                f.unlink(missing_ok=True)
        for key in rows.keys() - files.keys():
            self._sql("DELETE FROM entries WHERE key = ?", (key,))
        for key in files.keys() - rows.keys():
            rows[key] = files[key]
            self._sql("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)", (key, *files[key]))
        for key, (_, _) in sorted(((k, rows[k]) for k in files), key=lambda kv: kv[1][1]):
            self._index[key] = _DiskEntry(nbytes=files[key][0])
        self._stats.bytes_used = sum(e.nbytes for e in self._index.values())
        self._stats.entries = len(self._index)
        with self._lock:
            self._evict_until(0)
        logger.info("disk store %s: %d chunks, %.1f MiB", self.root, len(self._index), self._stats.bytes_used / 2**20)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._index)

    # ------------------------------------------------------------------ primitives
    def _entry(self, key: str) -> _DiskEntry | None:
        """The index entry, adopting a file another process wrote. Caller holds the lock."""
        e = self._index.get(key)
        if e is None:
            p = self.path(key)
            if not p.exists():
                return None
            e = self._index[key] = _DiskEntry(nbytes=p.stat().st_size)
            self._stats.bytes_used += e.nbytes
            self._stats.entries = len(self._index)
        return e

    def _load_meta(self, key: str, e: _DiskEntry) -> ChunkMeta | None:
        """Parse and check the header once. None (a miss) for missing, foreign or corrupt files."""
        if e.meta is not None:
            return e.meta
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            return None
        try:
            meta, offset = read_header(fd, key)
        except Corrupt as exc:
            self._drop_corrupt(key, str(exc))
            return None
        finally:
            os.close(fd)
        if not self.accepts(meta):
            self._stats.extra["foreign"] = self._stats.extra.get("foreign", 0) + 1
            logger.warning("disk chunk %s belongs to %s/%s, not %s/%s: miss", key, meta.fingerprint, meta.fmt,
                           self.fingerprint, self.kv_format)
            return None
        e.meta, e.data_offset = meta, offset
        return meta

    def meta(self, key: str) -> ChunkMeta | None:
        with self._lock:
            e = self._entry(key)
            return None if e is None else self._load_meta(key, e)

    def get_blob(self, key: str, layer: int) -> tuple[ChunkMeta, Blob] | None:
        return self._get_blob(key, layer, retry=True)

    def _get_blob(self, key: str, layer: int, retry: bool) -> tuple[ChunkMeta, Blob] | None:
        t0 = time.perf_counter()
        with self._lock:
            e = self._entry(key)
            meta = None if e is None else self._load_meta(key, e)
            if meta is None or layer >= meta.n_layers:
                if layer == 0:
                    self._stats.misses += 1
                return None
            offset = e.data_offset + layer * meta.layer_nbytes
            if layer == 0:
                self._touch(key)
        blob = self._read(key, offset, meta.layer_nbytes)
        if blob is None or checksum(blob) != meta.checksums[layer]:
            return self._recheck(key, layer, meta, "missing" if blob is None else "checksum mismatch", retry)
        with self._lock:
            self._stats.bytes_read += len(blob)
            self._stats.read_seconds += time.perf_counter() - t0
        return meta, blob

    def _read(self, key: str, offset: int, n: int) -> Blob | None:
        blob = bytearray(n)
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            got = os.preadv(fd, [blob], offset)
        finally:
            os.close(fd)
        return blob if got == n else bytearray()  # short read: truncated file, fails the checksum

    def _recheck(self, key: str, layer: int, meta: ChunkMeta, why: str, retry: bool = True
                 ) -> tuple[ChunkMeta, Blob] | None:
        """A bad read: maybe another writer replaced the file (re-read its header once), else corrupt."""
        with self._lock:
            e = self._index.get(key)
            if e is None:
                return None
            e.meta = None
            fresh = self._load_meta(key, e)  # forgets a vanished file, drops an unreadable one
            if fresh is None:
                return None
            if fresh == meta or not retry:
                self._drop_corrupt(key, f"layer {layer}: {why}")
                return None
        return self._get_blob(key, layer, retry=False)

    def put_blobs(self, key: str, meta: ChunkMeta, blobs: Sequence[Blob]) -> bool:
        self.check_meta(meta)
        if self.fingerprint and meta.fingerprint != self.fingerprint:
            raise ValueError(f"disk store {self.fingerprint!r} was given a chunk of {meta.fingerprint!r}")
        header = encode_header(key, meta)
        size = len(header) + meta.nbytes
        with self._lock:
            if size > self._budget:
                self._stats.skipped_puts += 1
                return False
            self._drop_entry(key)
            self._evict_until(size)
        for attempt in (0, 1):
            try:
                self._write(key, header, blobs)
                break
            except OSError as exc:  # disk full, read-only, quota: free room once, then skip the store
                self._stats.errors += 1
                logger.warning("disk store write of %s failed (%s)%s", key, exc, "" if attempt else "; evicting, retrying")
                with self._lock:
                    if attempt or not self._index:
                        self._stats.skipped_puts += 1
                        return False
                    self._evict_bytes(size)
        with self._lock:
            self._index[key] = _DiskEntry(nbytes=size, meta=meta, data_offset=len(header))
            self._stats.bytes_used += size
            self._stats.entries = len(self._index)
            self._stats.puts += 1
            self._sql("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)", (key, size, time.time()))
        return True

    def _write(self, key: str, header: bytes, blobs: Sequence[Blob]) -> None:
        final = self.path(key)
        final.parent.mkdir(exist_ok=True)
        tmp = final.with_name(f"{final.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                for b in blobs:
                    f.write(b)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # ------------------------------------------------------------------ bookkeeping (lock held)
    def _touch(self, key: str) -> None:
        self._index.move_to_end(key)
        self._stats.hits += 1
        self._sql("UPDATE entries SET last_used = ? WHERE key = ?", (time.time(), key))

    def _evict_until(self, incoming: int) -> None:
        while self._index and self._stats.bytes_used + incoming > self._budget:
            self._drop_entry(next(iter(self._index)))
            self._stats.evictions += 1

    def _evict_bytes(self, n: int) -> None:
        """Free at least n bytes (or everything), oldest first, whatever the budget says."""
        freed = 0
        while self._index and freed < n:
            key = next(iter(self._index))
            freed += self._index[key].nbytes
            self._drop_entry(key)
            self._stats.evictions += 1

    def _forget(self, key: str) -> None:
        e = self._index.pop(key, None)
        if e is not None:
            self._stats.bytes_used -= e.nbytes
            self._stats.entries = len(self._index)
        self._sql("DELETE FROM entries WHERE key = ?", (key,))

    def _drop_entry(self, key: str) -> bool:
        existed = key in self._index
        self._forget(key)
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return existed

    def _drop_corrupt(self, key: str, why: str) -> None:
        self._stats.corrupt += 1
        logger.warning("disk chunk %s is corrupt (%s); dropped, will be recomputed", key, why)
        self._drop_entry(key)

    # ------------------------------------------------------------------ KVStore
    def prefetch(self, keys: Sequence[str]) -> None:
        """Ask the kernel to start reading these files."""
        for key in keys:
            try:
                fd = os.open(self.path(key), os.O_RDONLY)
            except (FileNotFoundError, ValueError):
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._drop_entry(key)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**{**self._stats.__dict__, "extra": dict(self._stats.extra)})

    def close(self) -> None:
        with self._lock:
            self._db.close()
