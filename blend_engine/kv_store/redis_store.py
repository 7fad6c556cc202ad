"""Redis tier: the shared store that lets several service replicas reuse each other's passages.

One Redis hash per chunk, `<prefix><key>`, with field "meta" (the `ChunkMeta` JSON, including the
per-layer CRC32s and the fingerprint) and one field per layer ("0", "1", ...), so a layer is one
HMGET. A chunk is written in one MULTI/EXEC transaction: concurrent writers of a key leave one
complete entry. Memory limits and eviction are Redis' own (maxmemory + an LRU policy).

Every call has a socket timeout. When Redis is unreachable the tier reports misses, skips puts,
logs once, shows `available: False` in its stats, and tries again after `retry_after_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis

from blend_engine.kv_store.base import StoreStats
from blend_engine.kv_store.blob import Blob, BlobStore
from blend_engine.kv_store.codec import ChunkMeta

logger = logging.getLogger(__name__)
T = TypeVar("T")
_DOWN = object()


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisStore(BlobStore):
    def __init__(self, url: str, kv_format: str = "fp16", fingerprint: str = "", timeout_s: float = 0.5,
                 name: str = "redis", prefix: str = "blendserve:kv:", ttl_s: int | None = None,
                 retry_after_s: float = 5.0) -> None:
        super().__init__(name, kv_format, fingerprint)
        self.url = redact(url)
        self._prefix = prefix
        self._ttl = ttl_s
        self._retry_after = retry_after_s
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._lock = threading.Lock()
        self._available = True
        self._retry_at = 0.0
        self._stats = StoreStats(name=name, extra={"available": True, "url": self.url, "last_error": ""})

    # ------------------------------------------------------------------ availability
    def _call(self, fn: Callable[[redis.Redis], T]) -> T | object:
        """Run one Redis operation; `_DOWN` when Redis is (or just went) unreachable."""
        with self._lock:
            if not self._available and time.monotonic() < self._retry_at:
                return _DOWN
        try:
            out = fn(self._client)
        except (redis.RedisError, OSError) as exc:
            self._mark_down(exc)
            return _DOWN
        with self._lock:
            if not self._available:
                logger.warning("redis %s is reachable again; shared KV tier back in use", self.url)
                self._available = True
                self._stats.extra["available"] = True
        return out

    def _mark_down(self, exc: Exception) -> None:
        with self._lock:
            self._stats.errors += 1
            self._stats.extra["last_error"] = f"{type(exc).__name__}: {exc}"
            if self._available:
                logger.warning("redis %s unavailable (%s); serving from local tiers, retrying every %.0f s",
                               self.url, exc, self._retry_after)
            self._available = False
            self._stats.extra["available"] = False
            self._retry_at = time.monotonic() + self._retry_after

    @property
    def available(self) -> bool:
        with self._lock:
            return self._available

    def ping(self) -> bool:
        return self._call(lambda c: c.ping()) is True

    def _rk(self, key: str) -> str:
        return self._prefix + key

    def _count(self, field: str, n: int | float = 1) -> None:
        with self._lock:
            setattr(self._stats, field, getattr(self._stats, field) + n)

    # ------------------------------------------------------------------ primitives
    def _parse(self, key: str, raw: bytes | None) -> ChunkMeta | None:
        if raw is None:
            return None
        try:
            meta = ChunkMeta.from_json(raw)
        except (ValueError, KeyError, TypeError) as exc:
            self._drop_corrupt(key, f"bad meta: {exc}")
            return None
        return meta if self.accepts(meta) else None

    def meta(self, key: str) -> ChunkMeta | None:
        raw = self._call(lambda c: c.hget(self._rk(key), "meta"))
        return None if raw is _DOWN else self._parse(key, raw)

    def get_blob(self, key: str, layer: int) -> tuple[ChunkMeta, Blob] | None:
        t0 = time.perf_counter()
        got = self._call(lambda c: c.hmget(self._rk(key), ["meta", str(layer)]))
        meta = None if got is _DOWN else self._parse(key, got[0])
        if meta is None or layer >= meta.n_layers or got[1] is None:
            if layer == 0:
                self._count("misses")
            return None
        blob = bytearray(got[1])
        if not meta.verify(layer, blob):
            self._drop_corrupt(key, f"layer {layer} fails its checksum")
            return None
        with self._lock:
            self._stats.hits += layer == 0
            self._stats.bytes_read += len(blob)
            self._stats.read_seconds += time.perf_counter() - t0
        return meta, blob

    def put_blobs(self, key: str, meta: ChunkMeta, blobs: Sequence[Blob]) -> bool:
        self.check_meta(meta)
        mapping: dict[str, bytes | memoryview | str] = {"meta": meta.to_json()}
        mapping.update({str(i): memoryview(b) for i, b in enumerate(blobs)})

        def write(c: redis.Redis) -> bool:
            pipe = c.pipeline(transaction=True)
            pipe.delete(self._rk(key))
            pipe.hset(self._rk(key), mapping=mapping)
            if self._ttl:
                pipe.expire(self._rk(key), self._ttl)
            pipe.execute()
            return True

        if self._call(write) is _DOWN:
            self._count("skipped_puts")
            return False
        self._count("puts")
        return True

    # ------------------------------------------------------------------ KVStore
    def delete(self, key: str) -> bool:
        out = self._call(lambda c: c.delete(self._rk(key)))
        return out is not _DOWN and bool(out)

    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        self._client.close()
