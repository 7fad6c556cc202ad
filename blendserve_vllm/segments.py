"""One prompt's KV as a shared-memory segment: Blendserve writes it, vLLM's connector reads it.

A segment is a file in a shared-memory folder (`/dev/shm` by default), named by its handle:

    | header (4 KiB): magic, JSON meta | layer 0: K [T, H, D], V [T, H, D] | layer 1 ... | layer L-1 |

Layer-major, token-major inside a layer (the rows vLLM's cache writes take), in the meta's dtype.
`token_hash` is the hash of the T prompt token ids the KV belongs to: the connector hands the KV
to a request only when its prompt's first T ids hash the same. A segment is written under a
temporary name and renamed into place, so a reader never sees a half-written one.

For a vLLM server on another host the same bytes go through Redis instead (`RedisPublisher`,
`redis_handover`): filled in a host buffer (`fill_buffer`), read back into one
(`Segment.from_buffer`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from blendserve_vllm.redis_handover import RedisClient

logger = logging.getLogger(__name__)

MAGIC = b"BLENDKV1"
HEADER_BYTES = 4096
DEFAULT_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a handle is a bare file name, never a path
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SPARE = ".spare-"  # a loaded segment's file, renamed for its writer to reuse (`release`)
MAX_SPARES = 4  # spare files a publisher keeps (the newest)


class SegmentError(ValueError):
    """A handle or segment that cannot be used (bad name, gone, torn, or of another shape)."""


def token_hash(ids: Sequence[int]) -> str:
    """The segment's key for a prompt's token ids: sha256 of the ids as little-endian int64."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise SegmentError(f"no segment dtype for {dtype}")


@dataclass(frozen=True)
class SegmentMeta:
    """What a segment holds: L layers of K and V for T tokens, H kv heads of D dims each."""

    n_layers: int
    n_tokens: int
    kv_heads: int
    head_dim: int
    dtype: str
    token_hash: str

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def half_nbytes(self) -> int:
        """One layer's K (or V): T x H x D numbers."""
        return self.n_tokens * self.kv_heads * self.head_dim * self.itemsize

    @property
    def layer_nbytes(self) -> int:
        return 2 * self.half_nbytes

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.n_layers * self.layer_nbytes

    def encode(self) -> bytes:
        body = json.dumps(asdict(self), sort_keys=True).encode()
        head = MAGIC + len(body).to_bytes(4, "little") + body
        if len(head) > HEADER_BYTES:
            raise SegmentError("segment meta larger than its header")
        return head.ljust(HEADER_BYTES, b"\0")

    @classmethod
    def decode(cls, head: bytes) -> SegmentMeta:
        if len(head) < 12 or head[:8] != MAGIC:
            raise SegmentError("not a Blendserve KV segment (bad magic)")
        n = int.from_bytes(head[8:12], "little")
        try:
            meta = cls(**json.loads(head[12:12 + n]))
        except (ValueError, TypeError) as exc:
            raise SegmentError(f"unreadable segment meta: {exc}") from None
        sizes = (meta.n_layers, meta.n_tokens, meta.kv_heads, meta.head_dim)
        if not all(type(v) is int and v >= 1 for v in sizes) or meta.dtype not in DTYPES \
                or not isinstance(meta.token_hash, str):
            raise SegmentError(f"segment meta out of range: {meta}")
        return meta


def check_name(name: object) -> str:
    """A handle as given by a request: a bare file name (no folder, no `..`), or SegmentError."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise SegmentError(f"bad segment handle {name!r}")
    return name


def _unreadable(name: str, exc: OSError) -> SegmentError:
    """A file error as the reader's: gone, or not readable here (a folder, another user's file, ...)."""
    if isinstance(exc, FileNotFoundError):
        return SegmentError(f"segment {name} is gone")
    return SegmentError(f"segment {name} cannot be read: {exc.strerror or exc}")


class Segment:
    """An open segment: `k(layer)` / `v(layer)` are views [T, H, D] of its memory, a mapped file
    (`open`) or a buffer in memory (`from_buffer`, what came from Redis). `name` is its handle's name."""

    def __init__(self, path: Path | None, meta: SegmentMeta, buf: mmap.mmap | bytearray | memoryview,
                 name: str | None = None) -> None:
        self.path, self.meta, self._buf = path, meta, buf
        self.name = name if name is not None else path.name
        self._data = torch.frombuffer(buf, dtype=torch.uint8)  # [nbytes]

    @classmethod
    def open(cls, folder: str | Path, name: str) -> Segment:
        """Map an existing segment for reading (private copy-on-write pages: nothing is written back)."""
        path = Path(folder) / check_name(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise _unreadable(name, exc) from None
        try:
            size = os.fstat(fd).st_size
            meta = SegmentMeta.decode(os.pread(fd, HEADER_BYTES, 0))
            if size != meta.nbytes:
                raise SegmentError(f"segment {name} holds {size} bytes, its meta says {meta.nbytes}")
            mm = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise _unreadable(name, exc) from None
        finally:
            os.close(fd)
        return cls(path, meta, mm)

    @classmethod
    def from_buffer(cls, name: str, buf: bytearray | memoryview | bytes) -> Segment:
        """A segment over bytes in memory, sized as its header says (else SegmentError); its views
        share `buf`'s memory (a read-only buffer is copied once, so they stay writable)."""
        view = memoryview(buf).cast("B")
        if view.readonly:
            view = memoryview(bytearray(view))
        meta = SegmentMeta.decode(bytes(view[:HEADER_BYTES]))
        if view.nbytes != meta.nbytes:
            raise SegmentError(f"segment {name} holds {view.nbytes} bytes, its meta says {meta.nbytes}")
        return cls(None, meta, view, name)

    @staticmethod
    def read_meta(folder: str | Path, name: str) -> SegmentMeta:
        """The header alone (the connector's scheduler side), or SegmentError."""
        path = Path(folder) / check_name(name)
        try:
            with open(path, "rb") as fh:
                meta = SegmentMeta.decode(fh.read(HEADER_BYTES))
                if os.fstat(fh.fileno()).st_size != meta.nbytes:
                    raise SegmentError(f"segment {name} is torn")
                return meta
        except OSError as exc:
            raise _unreadable(name, exc) from None

    def _half(self, layer: int, which: int) -> torch.Tensor:
        m = self.meta
        start = HEADER_BYTES + layer * m.layer_nbytes + which * m.half_nbytes
        raw = self._data[start:start + m.half_nbytes]  # [T * H * D * itemsize]
        return raw.view(DTYPES[m.dtype]).view(m.n_tokens, m.kv_heads, m.head_dim)  # [T, H, D]

    def k(self, layer: int) -> torch.Tensor:
        return self._half(layer, 0)  # [T, H, D]

    def v(self, layer: int) -> torch.Tensor:
        return self._half(layer, 1)  # [T, H, D]

    def close(self) -> None:
        self._data = None
        if isinstance(self._buf, mmap.mmap):
            self._buf.close()
        self._buf = None


def write_segment(folder: str | Path, name: str, meta: SegmentMeta,
                  fill: Callable[[int, torch.Tensor, torch.Tensor], None], reuse: Path | None = None) -> Path:
    """Create segment `name`: `fill(layer, k, v)` writes each layer into the views k, v [T, H, D];
    the file appears under its name only once complete. `reuse`: a spare file (a loaded segment's,
    `release`) whose pages are taken instead of a new file's (gone meanwhile: a new file)."""
    folder = Path(folder)
    path = folder / check_name(name)
    tmp = folder / f".{name}.tmp"
    fd = _reuse(reuse, tmp)
    reused = fd is not None
    if fd is None:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, meta.nbytes)
        os.pwrite(fd, meta.encode(), 0)
        # a spare's pages exist: map them all at once (a new file's would be allocated one fault at a time)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if reused else 0)
        mm = mmap.mmap(fd, meta.nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    seg = Segment(tmp, meta, mm)
    try:
        for layer in range(meta.n_layers):
            fill(layer, seg.k(layer), seg.v(layer))
        seg.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _reuse(spare: Path | None, tmp: Path) -> int | None:
    """The spare renamed to `tmp` and opened; None when there is none (or another writer took it)."""
    if spare is None:
        return None
    try:
        os.replace(spare, tmp)
        return os.open(tmp, os.O_RDWR)
    except FileNotFoundError:
        return None


def release(folder: str | Path, name: str) -> bool:
    """A loaded segment handed back to its writer: renamed to its spare name (`SPARE`), whose pages
    the writer's next segment reuses (a new file's pages cost 2-4x the copy into them); unlinked when
    that fails. False when it was already gone."""
    src = Path(folder) / check_name(name)
    try:
        os.replace(src, src.with_name(SPARE + name))
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return remove(folder, name)


def fill_buffer(meta: SegmentMeta, fill: Callable[[int, torch.Tensor, torch.Tensor], None]) -> bytearray:
    """A segment built in memory (what goes to Redis): the header, then `fill(layer, k, v)` writes
    each layer into the views k, v [T, H, D] of the buffer."""
    buf = bytearray(meta.nbytes)
    buf[:HEADER_BYTES] = meta.encode()
    seg = Segment(None, meta, buf, "in-memory")
    try:
        for layer in range(meta.n_layers):
            fill(layer, seg.k(layer), seg.v(layer))
    finally:
        seg.close()
    return buf


def remove(folder: str | Path, name: str) -> bool:
    """Unlink a segment; False when it was already gone (the other side freed it)."""
    try:
        (Path(folder) / check_name(name)).unlink()
        return True
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class Published:
    """A segment this process wrote: its handle, size, when, and the prompt's token hash."""

    name: str
    nbytes: int
    created: float
    token_hash: str


class _Publisher:
    """What both publishers share: the byte budget (the oldest freed first), the TTL, unique handles,
    the records of what is outstanding and the counters. A subclass writes (`_write`), tells which
    segments vLLM freed (`_gone`) and frees (`_free`)."""

    prefix = ""  # a handle's prefix: how the connector knows where to look

    def __init__(self, budget_bytes: int, ttl_s: float, clock: Callable[[], float]) -> None:
        self.budget_bytes, self.ttl_s, self.clock = budget_bytes, ttl_s, clock
        self._live: OrderedDict[str, Published] = OrderedDict()  # handle -> record, oldest first
        self._lock = threading.Lock()
        self._ids = iter(range(1 << 62))
        self._tag = f"{os.getpid()}{secrets.token_hex(4)}"  # pids coincide across containers and hosts
        self.published = self.evicted = self.expired = 0

    def new_name(self, ids_hash: str) -> str:
        """A handle unique across processes, containers and hosts sharing the hand-over."""
        with self._lock:
            return f"{self.prefix}blendserve-{ids_hash[:16]}-{self._tag}-{next(self._ids)}"

    def publish(self, meta: SegmentMeta, fill: Callable[[int, torch.Tensor, torch.Tensor], None]) -> Published:
        """Write one segment (`fill(layer, k, v)` fills each layer's views), after making room for it."""
        if meta.nbytes > self.budget_bytes:
            raise SegmentError(f"a segment of {meta.nbytes} bytes exceeds the hand-over budget of "
                               f"{self.budget_bytes} bytes")
        self.sweep(room=meta.nbytes)
        handle = self.new_name(meta.token_hash)
        self._write(handle, meta, fill)
        rec = Published(handle, meta.nbytes, self.clock(), meta.token_hash)
        with self._lock:
            self._live[handle] = rec
            self.published += 1
        return rec

    def sweep(self, room: int = 0) -> None:
        """Forget segments vLLM freed, free the expired, then the oldest until `room` bytes fit."""
        now = self.clock()
        with self._lock:
            handles = list(self._live)
            for handle, gone in zip(handles, self._gone(handles)):
                if gone:
                    del self._live[handle]
            expired = [h for h, rec in self._live.items() if now - rec.created > self.ttl_s]
            for handle in expired:
                del self._live[handle]
            evicted = []
            while self._live and self.live_bytes + room > self.budget_bytes:
                evicted.append(self._live.popitem(last=False)[0])
            self.expired += self._free(expired)
            self.evicted += self._free(evicted)

    @property
    def live_bytes(self) -> int:
        return sum(r.nbytes for r in self._live.values())

    def stats(self) -> dict:
        with self._lock:
            return {"segments": len(self._live), "bytes": self.live_bytes, "published": self.published,
                    "evicted": self.evicted, "expired": self.expired}

    def close(self) -> None:
        """Free every segment this publisher still holds."""
        with self._lock:
            handles = list(self._live)
            self._live.clear()
        self._free(handles)

    def _write(self, handle: str, meta: SegmentMeta, fill: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        raise NotImplementedError

    def _gone(self, handles: Sequence[str]) -> list[bool]:
        raise NotImplementedError

    def _free(self, handles: Sequence[str]) -> int:
        raise NotImplementedError


class SegmentPublisher(_Publisher):
    """Blendserve's side: writes segments into `folder`, at most `budget_bytes` of them at once
    (the oldest freed first) and none older than `ttl_s` (a segment vLLM never loaded: its request
    failed or was cancelled before it was scheduled). vLLM frees a segment once it loaded it."""

    def __init__(self, folder: str | Path = DEFAULT_DIR, budget_bytes: int = 2 << 30, ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(budget_bytes, ttl_s, clock)
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SegmentError(f"segment folder {self.folder} does not exist")

    def _write(self, handle: str, meta: SegmentMeta, fill: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        write_segment(self.folder, handle, meta, fill, reuse=self._spare_for(meta.nbytes))

    def _gone(self, handles: Sequence[str]) -> list[bool]:
        return [not (self.folder / h).exists() for h in handles]

    def _free(self, handles: Sequence[str]) -> int:
        return sum(remove(self.folder, h) for h in handles)

    def _spares(self) -> list[tuple[Path, int]]:
        """This publisher's spare files (segments the connector loaded and released), with sizes,
        newest first."""
        found = []
        for path in self.folder.glob(f"{SPARE}blendserve-*-{self._tag}-*"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime_ns, path, st.st_size))
        return [(p, n) for _, p, n in sorted(found, reverse=True)]

    def _spare_for(self, nbytes: int) -> Path | None:
        """The spare to reuse: the smallest that holds `nbytes`, else the largest; the ones past
        `MAX_SPARES` are unlinked."""
        spares = self._spares()
        for path, _ in spares[MAX_SPARES:]:
            path.unlink(missing_ok=True)
        spares = spares[:MAX_SPARES]
        if not spares:
            return None
        fits = [s for s in spares if s[1] >= nbytes]
        return min(fits, key=lambda s: s[1])[0] if fits else max(spares, key=lambda s: s[1])[0]

    def close(self) -> None:
        """Free every segment this publisher still holds, and its spare files."""
        super().close()
        for path, _ in self._spares():
            path.unlink(missing_ok=True)


class RedisPublisher(_Publisher):
    """Blendserve's side for a vLLM server on another host: the same segments, each filled in a host
    buffer and SET under `blendserve:segment:<name>` with EX `ttl_s` (Redis drops one vLLM never
    loaded); its handle is "redis:<name>" (`redis_handover`). At most `budget_bytes` of this
    publisher's segments are outstanding at once (the oldest DEL'd first); vLLM DELs a key once it
    loaded it, which `sweep` notices. Redis down or refusing: SegmentError (a `RedisError`)."""

    def __init__(self, url: str, budget_bytes: int = 2 << 30, ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, timeout_s: float = 5.0) -> None:
        from blendserve_vllm import redis_handover  # it imports this module

        super().__init__(budget_bytes, ttl_s, clock)
        self._rh = redis_handover
        self.prefix = redis_handover.HANDLE_PREFIX
        self.client: RedisClient = redis_handover.RedisClient(url, timeout_s)

    def _write(self, handle: str, meta: SegmentMeta, fill: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        buf = fill_buffer(meta, fill)
        self.client.set(self._key(handle), memoryview(buf), ex_s=max(1, math.ceil(self.ttl_s)))

    def _gone(self, handles: Sequence[str]) -> list[bool]:
        return [not there for there in self.client.exists_each([self._key(h) for h in handles])]

    def _free(self, handles: Sequence[str]) -> int:
        return self.client.delete(*(self._key(h) for h in handles)) if handles else 0

    def _key(self, handle: str) -> str:
        return self._rh.segment_key(self._rh.redis_name(handle))

    def close(self) -> None:
        """DEL every segment this publisher still holds (Redis down: they expire there), and disconnect."""
        try:
            super().close()
        except SegmentError as exc:
            logger.warning("could not free the hand-over segments in Redis (%s); they expire there", exc)
        finally:
            self.client.close()
