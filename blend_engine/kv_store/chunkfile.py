"""The disk tier's file format: one file per chunk, layer-major, written atomically.

File layout (little endian)::

    b"BLKV\\x01\\n\\0\\0" | u32 header length | header JSON (ChunkMeta + key) | zero pad to 4 KiB
    | layer 0 blob | layer 1 blob | ... (each `meta.layer_nbytes` long)

so layer i is one positioned read at `data_offset + i * layer_nbytes`. Files are written to a
temporary name in the same folder and renamed into place, so a reader (or a second writer of the
same key, even in another process) only ever sees a complete file. A crash mid-write leaves at
worst a stale temporary file or, without fsync, a damaged file, which the per-layer checksums in
the header catch.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path

from blend_engine.kv_store.codec import ChunkMeta

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
    """n bytes at offset; None when the file is gone, b"" on a short read (a truncated file)."""
    blob = bytearray(n)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        got = os.preadv(fd, [blob], offset)
    finally:
        os.close(fd)
    return blob if got == n else bytearray()


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
