"""The disk tier's file format: one file per chunk, layer-major, written atomically.

File layout (little endian)::

    b"BLKV\\x01\\n\\0\\0" | u32 header length | header JSON (ChunkMeta + key) | zero pad to 4 KiB
    | layer 0 blob | layer 1 blob | ... (each `meta.layer_nbytes` long)

so layer i is one positioned read at `data_offset + i * layer_nbytes`, straight into the caller's
buffer (`read_into`; with O_DIRECT the aligned span around it). A request opens each file once
(`OpenFiles`) and reads all its layers through that descriptor. Files are written to a
temporary name in the same folder and renamed into place, so a reader (or a second writer of the
same key, even in another process) only ever sees a complete file. A crash mid-write leaves at
worst a stale temporary file or, without fsync, a damaged file, which the per-layer checksums in
the header catch.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from blend_engine.kv_store.codec import ChunkMeta

logger = logging.getLogger(__name__)
MAGIC = b"BLKV\x01\n\x00\x00"
_LEN = struct.Struct("<I")
_ALIGN = 4096
_MAX_HEADER = 1 << 20


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


def read_file_header(path: Path, key: str) -> tuple[ChunkMeta, int] | None:
    """(meta, data offset) of a chunk file; None when it does not exist; raises Corrupt."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return read_header(fd, key)
    finally:
        os.close(fd)


def read_at(path: Path, offset: int, n: int) -> bytearray | None:
    """n bytes at offset into a new buffer; None when the file is gone, b"" on a short read (a truncated file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        got = read_into(fd, offset, n, bytearray(n))
    finally:
        os.close(fd)
    return bytearray() if got is None else got


def read_into(fd: int, offset: int, n: int, into, direct: bool = False):
    """One positioned read of n bytes at offset into `into` (writable, bytes-like); the n bytes read
    (`into` itself, or a view of it), None on a short read. `direct`: fd was opened with O_DIRECT,
    so the aligned span around the bytes is read (`into` must be aligned and hold it)."""
    start = offset - offset % _ALIGN if direct else offset
    span = -(-(offset + n - start) // _ALIGN) * _ALIGN if direct else n
    got = os.preadv(fd, [memoryview(into)[:span]], start)
    if got < offset + n - start:
        return None
    if not direct and span == len(into):
        return into
    return memoryview(into)[offset - start:offset - start + n]


class OpenFiles:
    """The chunk files one request reads, each opened once (O_DIRECT when asked and supported) and
    closed with the request. Thread-safe: several reader threads share it."""

    def __init__(self, direct: bool = False) -> None:
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._fds: dict[str, tuple[int, bool]] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> tuple[int, bool] | None:
        """(fd, opened with O_DIRECT) of the file; None when it does not exist."""
        with self._lock:
            if path in self._fds:
                return self._fds[path]
        got = self._open(path)
        if got is None:
            return None
        with self._lock:
            if path in self._fds:  # another reader opened it meanwhile
                os.close(got[0])
                return self._fds[path]
            self._fds[path] = got
        return got

    def _open(self, path: str) -> tuple[int, bool] | None:
        try:
            if self.direct:
                try:
                    return os.open(path, os.O_RDONLY | os.O_DIRECT), True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    logger.warning("O_DIRECT is not supported for %s; reading through the page cache", path)
                    self.direct = False
            return os.open(path, os.O_RDONLY), False
        except FileNotFoundError:
            return None

    def forget(self, path: str) -> None:
        """Close a file (it was replaced or found bad): the next read opens it again."""
        with self._lock:
            got = self._fds.pop(path, None)
        if got is not None:
            os.close(got[0])

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd, _ in fds:
            os.close(fd)


def write_atomic(path: Path, header: bytes, blobs: Sequence[bytes | bytearray]) -> None:
    """Write header and blobs to a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for b in blobs:
                f.write(b)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def advise_willneed(path: Path) -> None:
    """Ask the kernel to start reading a file (nothing when it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
