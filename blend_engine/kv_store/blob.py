"""`BlobStore`: a KV store built on three byte-level primitives every tier implements.

- meta(key): the chunk's `ChunkMeta` (None when absent, or stored by another fingerprint/format);
- get_blob(key, layer): (meta, that layer's verified blob) or None (miss, corrupt -> dropped);
- put_blobs(key, meta, blobs): store every layer's blob; False when skipped.

A tier that keeps its blobs in memory says so (`holds_blobs`); a layer stream asks `in_memory(key)`
once per chunk and gets those chunks with get_blob on its own thread, in one pass per layer
(copied into the staging slot when its consumer gathers; no reader-pool round trip per blob),
while the others are read through the pool. get_blob stays the one read primitive.

A layer stream calls get_blob inside `staging.reading_into(region, files)`: a tier that reads bytes
from elsewhere (the disk) puts them into that staging region, through the stream's open files; a
tier that holds them (memory) returns its own buffer.

Tiers exchange blobs, never re-encode, so a promoted int8 chunk stays bit-identical.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from blend_engine.errors import CorruptChunk
from blend_engine.kv_store.base import ChunkKV, KVStore, StoreStats
from blend_engine.kv_store.chunkfile import OpenFiles
from blend_engine.kv_store.codec import (
    ChunkMeta,
    QuantLayer,
    check_format,
    decode_chunk,
    decode_layer,
    encode_chunk,
)

logger = logging.getLogger(__name__)

Blob = bytearray


class BlobStore(KVStore):
    _lock: AbstractContextManager  # every tier guards its stats with its lock
    _stats: StoreStats
    direct_io: bool = False  # layer streams read this tier's files with O_DIRECT
    holds_blobs: bool = False  # its blobs are its own buffers in memory (stable, no I/O to get them)
    blob_level = True

    def __init__(self, name: str, kv_format: str, fingerprint: str = "") -> None:
        self.name = name
        self.kv_format = check_format(kv_format)
        self.fingerprint = fingerprint

    # ------------------------------------------------------------------ primitives
    @abstractmethod
    def meta(self, key: str) -> ChunkMeta | None: ...

    @abstractmethod
    def get_blob(self, key: str, layer: int) -> tuple[ChunkMeta, Blob] | None: ...

    @abstractmethod
    def put_blobs(self, key: str, meta: ChunkMeta, blobs: Sequence[Blob]) -> bool: ...

    @property
    def kind(self) -> str:
        """"device", "memory" or "storage" (`StoreStats.kind`), fixed when the tier is built."""
        return self._stats.kind

    def in_memory(self, key: str) -> bool:
        """Whether this store serves the chunk from memory (no I/O): get_blob then costs a lookup."""
        return self.holds_blobs and self.meta(key) is not None

    def count_staging(self, seconds: float) -> None:
        """Time a layer stream spent copying this store's held blobs into a staging buffer: part of
        delivering them (counted as read time; their bytes were counted when they were handed out)."""
        with self._lock:
            self._stats.read_seconds += seconds

    def count_upload(self, nbytes: int, seconds: float) -> None:
        """A layer stream's host-to-device copies of blobs from this store (bytes, seconds), for the
        controller's whole-path estimate (stats extra `upload_bytes`, `upload_seconds`)."""
        with self._lock:
            self._stats.extra["upload_bytes"] = self._stats.extra.get("upload_bytes", 0) + nbytes
            self._stats.extra["upload_seconds"] = self._stats.extra.get("upload_seconds", 0.0) + seconds

    def can_hold(self, nbytes: int) -> bool:
        """Whether a chunk of this many bytes fits the tier's budget at all (evicting others). Default: yes."""
        return True

    def prefetch(self, keys: Sequence[str], files: OpenFiles | None = None) -> None:
        """Hint that these chunks will be read soon (through `files`, a stream's descriptors). Default: nothing."""

    def open_files(self) -> OpenFiles:
        """The descriptors one layer stream reads through; the caller closes them."""
        return OpenFiles()

    def check_meta(self, meta: ChunkMeta) -> None:
        """Fail loudly when a caller hands this tier blobs of another format."""
        if meta.fmt != self.kv_format:
            raise ValueError(f"{self.name} stores {self.kv_format}, was given {meta.fmt} blobs")

    def accepts(self, meta: ChunkMeta) -> bool:
        """A stored entry is usable only in this store's format and (when set) fingerprint."""
        return meta.fmt == self.kv_format and (not self.fingerprint or meta.fingerprint == self.fingerprint)

    # ------------------------------------------------------------------ KVStore
    def contains(self, key: str) -> bool:
        return self.meta(key) is not None

    def put(self, key: str, kv: ChunkKV) -> bool:
        meta, blobs = encode_chunk(self.kv_format, kv, self.fingerprint)
        return self.put_blobs(key, meta, blobs)

    def get_layer(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._decoded_layer(key, layer, quantized=False)  # [H, T, D] each

    def get_layer_stored(self, key: str, layer: int) -> tuple[torch.Tensor, torch.Tensor] | QuantLayer | None:
        return self._decoded_layer(key, layer, quantized=True)  # int8: not dequantized here

    def _decoded_layer(self, key: str, layer: int, quantized: bool):
        got = self.get_blob(key, layer)
        if got is None:
            return None
        try:
            return decode_layer(*got, quantized=quantized)
        except CorruptChunk as exc:
            self._drop_corrupt(key, str(exc))
            return None

    def get_blobs(self, key: str) -> tuple[ChunkMeta, list[Blob]] | None:
        meta = self.meta(key)
        if meta is None:
            return None
        blobs: list[Blob] = []
        for layer in range(meta.n_layers):
            got = self.get_blob(key, layer)
            if got is None or got[0] != meta:
                return None
            blobs.append(got[1])
        return meta, blobs

    def get(self, key: str) -> ChunkKV | None:
        got = self.get_blobs(key)
        if got is None:
            return None
        try:
            return decode_chunk(*got)
        except CorruptChunk as exc:
            self._drop_corrupt(key, str(exc))
            return None

    def _drop_corrupt(self, key: str, why: str) -> None:
        """A chunk that fails its checks or does not decode is a storage fault, never the caller's:
        counted (under the tier's lock), logged and dropped; it is a miss and gets recomputed."""
        with self._lock:
            self._stats.corrupt += 1
        logger.warning("KV chunk %s in %s is unreadable (%s); dropped, will be recomputed", key, self.name, why)
        self.delete(key)
