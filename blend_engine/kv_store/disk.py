"""Local disk tier: one file per chunk (`chunkfile`: layer-major, per-layer checksums, atomic writes),
an SQLite index of sizes and last use (`chunk_index`), and the byte-budget LRU (`lru`) that the
memory tier uses too.

A bad read (checksum, short file) re-reads the file's header once, since another writer (even in
another process) may have replaced the file; otherwise the chunk is dropped as corrupt: a miss,
recomputed by the caller. A failed write (disk full, read-only, quota) frees room once and
retries, then skips the store. A file another process wrote is adopted on first use. On start-up
the index is reconciled with the files present (both ways) and stale temporary files are removed.

Inside a layer stream (`staging.reading_into`) each layer blob is read straight into the stream's
staging region, through a descriptor opened once per stream (`chunkfile.OpenFiles`, O_DIRECT when
the store was built with `direct_io`), and verified there (XXH3, see `codec`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from blend_engine.kv_store.base import StoreStats
from blend_engine.kv_store.blob import Blob, BlobStore
from blend_engine.kv_store.chunk_index import ChunkIndex
from blend_engine.kv_store.chunkfile import (
    Corrupt,
    OpenFiles,
    advise_willneed,
    encode_header,
    read_at,
    read_file_header,
    read_into,
    write_atomic,
)
from blend_engine.kv_store.codec import ChunkMeta
from blend_engine.kv_store.lru import ByteLRU
from blend_engine.kv_store.staging import read_target

logger = logging.getLogger(__name__)

_STALE_TMP_S = 3600.0


@dataclass
class _DiskEntry:
    meta: ChunkMeta | None = None  # parsed lazily from the file header
    data_offset: int = 0
    path: str | None = None  # the file's path, kept for the hot read path


class DiskStore(BlobStore):
    def __init__(self, root: Path | str, budget_bytes: int = 20 << 30, kv_format: str = "fp16",
                 fingerprint: str = "", name: str = "disk", direct_io: bool = False) -> None:
        super().__init__(name, kv_format, fingerprint)
        self.root = Path(root)
        self.direct_io = direct_io  # layer streams read with O_DIRECT (bypassing the page cache)
        self._chunks = self.root / "chunks"
        self._chunks.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._stats = StoreStats(name=name, bytes_budget=budget_bytes, extra={"dir": str(self.root)})
        self._lru: ByteLRU[_DiskEntry] = ByteLRU(budget_bytes, self._stats)
        self._index = ChunkIndex(self.root / "index.sqlite", self._stats)
        self._load_index()

    def path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad chunk key {key!r}")
        return self._chunks / key[:2] / f"{key}.kv"

    # ------------------------------------------------------------------ start-up
    def _load_index(self) -> None:
        """Rows from the index, reconciled with the files present (both ways), oldest use first."""
        rows = self._index.rows()
        files = self._scan_files()
        for key in rows.keys() - files.keys():
            self._index.delete(key)
        for key in files.keys() - rows.keys():
            rows[key] = files[key]
            self._index.put(key, *files[key])
        with self._lock:
            for key in sorted(files, key=lambda k: rows[k][1]):
                self._lru.add(key, files[key][0], _DiskEntry())
            self._remove(self._lru.evict_for(0))
        logger.info("disk store %s: %d chunks, %.1f MiB", self.root, len(self._lru), self._stats.bytes_used / 2**20)

    def _scan_files(self) -> dict[str, tuple[int, float]]:
        """Chunk files present: key -> (size, mtime). Temporary files older than an hour are removed.
        A file another process renames or removes between the listing and its stat is skipped."""
        files: dict[str, tuple[int, float]] = {}
        now = time.time()
        for f in self._chunks.glob("*/*"):
            try:
                st = f.stat()
            except FileNotFoundError:  # another writer's temporary file, renamed into place meanwhile
                continue
            if f.suffix == ".kv":
                files[f.stem] = (st.st_size, st.st_mtime)
            elif ".tmp" in f.name and now - st.st_mtime > _STALE_TMP_S:
                f.unlink(missing_ok=True)
        return files

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return self._lru.keys()

    # ------------------------------------------------------------------ lookups (lock held)
    def _entry(self, key: str) -> _DiskEntry | None:
        """The LRU entry, adopting a file another process wrote."""
        e = self._lru.get(key)
        if e is None:
            p = self.path(key)
            if not p.exists():
                return None
            e = _DiskEntry()
            self._lru.add(key, p.stat().st_size, e)
        return e

    def _load_meta(self, key: str, e: _DiskEntry) -> ChunkMeta | None:
        """Parse and check the header once. None (a miss) for missing, foreign or corrupt files."""
        if e.meta is not None:
            return e.meta
        try:
            got = read_file_header(self.path(key), key)
        except Corrupt as exc:
            self._drop_corrupt(key, str(exc))
            return None
        if got is None:
            self._forget(key)
            return None
        meta, offset = got
        if not self.accepts(meta):
            self._stats.extra["foreign"] = self._stats.extra.get("foreign", 0) + 1
            logger.warning("disk chunk %s belongs to %s/%s, not %s/%s: miss", key, meta.fingerprint, meta.fmt,
                           self.fingerprint, self.kv_format)
            return None
        e.meta, e.data_offset = meta, offset
        return meta

    def _locate(self, key: str, layer: int, touch: bool) -> tuple[ChunkMeta, int, str] | None:
        """(meta, file offset of the layer's blob); counts a miss, or a hit when layer 0 is touched."""
        with self._lock:
            e = self._entry(key)
            meta = None if e is None else self._load_meta(key, e)
            if e is None or meta is None or layer >= meta.n_layers:
                if layer == 0:
                    self._stats.misses += 1
                return None
            if layer == 0 and touch:
                self._lru.touch(key)
                self._stats.hits += 1
                self._index.touch(key)
            if e.path is None:
                e.path = str(self.path(key))
            return meta, e.data_offset + layer * meta.layer_nbytes, e.path

    def _replaced(self, key: str, layer: int, meta: ChunkMeta, why: str, retry: bool) -> bool:
        """After a bad read: True when another writer replaced the file (read it again); otherwise
        a vanished file is forgotten and a damaged one dropped as corrupt."""
        with self._lock:
            e = self._lru.get(key)
            if e is None:
                return False
            e.meta = None
            fresh = self._load_meta(key, e)  # forgets a vanished file, drops an unreadable one
            if fresh is None:
                return False
            if fresh == meta or not retry:
                self._drop_corrupt(key, f"layer {layer}: {why}")
                return False
            return True

    # ------------------------------------------------------------------ BlobStore primitives
    def meta(self, key: str) -> ChunkMeta | None:
        with self._lock:
            e = self._entry(key)
            return None if e is None else self._load_meta(key, e)

    def get_blob(self, key: str, layer: int) -> tuple[ChunkMeta, Blob] | None:
        """The verified layer blob, read into this thread's staging region through the stream's open
        files when in a stream (`staging.reading_into`), else into a new buffer; None on a miss or
        a bad file (dropped)."""
        into, files = read_target()
        t0 = time.perf_counter()
        for attempt in (0, 1):
            found = self._locate(key, layer, touch=attempt == 0)
            if found is None:
                return None
            meta, offset, path = found
            blob = self._read(path, offset, meta.layer_nbytes, into, files, again=attempt > 0)
            if blob is not None and meta.verify(layer, blob):
                with self._lock:
                    self._stats.bytes_read += len(blob)
                    self._stats.read_seconds += time.perf_counter() - t0
                return meta, blob
            if not self._replaced(key, layer, meta, "missing" if blob is None else "checksum mismatch", attempt == 0):
                return None
        return None

    @staticmethod
    def _read(path: str, offset: int, n: int, into, files: OpenFiles | None, again: bool):
        """n bytes of the file at offset: None when it is gone, b"" on a short read."""
        if into is None:
            return read_at(Path(path), offset, n)
        own = files is None
        files = files or OpenFiles()
        try:
            if again:
                files.forget(path)  # the file may have been replaced since this stream opened it
            got = files.get(path)
            if got is None:
                return None
            blob = read_into(got[0], offset, n, into, direct=got[1])
            return bytearray() if blob is None else blob
        finally:
            if own:
                files.close()

    def open_files(self) -> OpenFiles:
        """The descriptors one layer stream reads through (closed when it ends)."""
        return OpenFiles(direct=self.direct_io)

    def put_blobs(self, key: str, meta: ChunkMeta, blobs: Sequence[Blob]) -> bool:
        self.check_meta(meta)
        if self.fingerprint and meta.fingerprint != self.fingerprint:
            raise ValueError(f"disk store {self.fingerprint!r} was given a chunk of {meta.fingerprint!r}")
        header = encode_header(key, meta)
        size = len(header) + meta.nbytes
        with self._lock:
            if not self._lru.fits(size):
                self._stats.skipped_puts += 1
                return False
            self._drop_entry(key)
            self._remove(self._lru.evict_for(size))
        if not self._write(key, header, blobs, size):
            return False
        with self._lock:
            self._lru.add(key, size, _DiskEntry(meta=meta, data_offset=len(header)))
            self._stats.puts += 1
            self._index.put(key, size)
        return True

    def _write(self, key: str, header: bytes, blobs: Sequence[Blob], size: int) -> bool:
        """Write the chunk file. Disk full, read-only, quota: free `size` bytes once and retry, then skip."""
        for attempt in (0, 1):
            try:
                write_atomic(self.path(key), header, blobs)
                return True
            except OSError as exc:
                self._stats.errors += 1
                logger.warning("disk store write of %s failed (%s)%s", key, exc, "" if attempt else "; evicting, retrying")
                with self._lock:
                    if attempt or not len(self._lru):
                        self._stats.skipped_puts += 1
                        return False
                    self._remove(self._lru.evict_bytes(size))
        return False

    # ------------------------------------------------------------------ removal (lock held)
    def _remove(self, keys: list[str]) -> None:
        """Delete the index rows and files of keys the LRU has already forgotten."""
        for key in keys:
            self._index.delete(key)
            self.path(key).unlink(missing_ok=True)

    def _forget(self, key: str) -> None:
        self._lru.pop(key)
        self._index.delete(key)

    def _drop_entry(self, key: str) -> bool:
        existed = key in self._lru
        self._forget(key)
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return existed

    # ------------------------------------------------------------------ KVStore
    def prefetch(self, keys: Sequence[str], files: OpenFiles | None = None) -> None:
        """Ask the kernel to start reading these files (opened through `files`, a stream's own)."""
        for key in keys:
            try:
                path = self.path(key)
            except ValueError:
                continue
            if files is None:
                advise_willneed(path)
                continue
            got = files.get(str(path))
            if got is not None and not got[1]:  # O_DIRECT reads skip the page cache
                os.posix_fadvise(got[0], 0, 0, os.POSIX_FADV_WILLNEED)

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._drop_entry(key)

    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            self._index.close()
