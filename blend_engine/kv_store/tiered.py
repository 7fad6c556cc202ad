"""Tiers composed into one store: device over memory over disk over Redis.

Reads try the tiers top-down. A chunk served by a lower tier is promoted upward (into every tier
above it with room) once all of its layers have passed through (layer-wise streams keep their
overlap: nothing is read twice), or at once by `get`: hot chunks move up, and each tier evicts its
least recently used chunks by bytes. Writes go through to every tier. A failing tier (Redis down,
disk full) only makes its own puts skip; the other tiers keep serving.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from blend_engine.kv_store.base import StoreStats
from blend_engine.kv_store.blob import Blob, BlobStore
from blend_engine.kv_store.chunkfile import OpenFiles
from blend_engine.kv_store.codec import ChunkMeta
from blend_engine.kv_store.staging import read_target

logger = logging.getLogger(__name__)
_SUMMED = ("corrupt", "errors", "evictions", "bytes_read", "read_seconds", "bytes_used", "bytes_budget", "entries")


@dataclass
class _Partial:
    meta: ChunkMeta
    source: int
    blobs: list[Blob | None]


class TieredStore(BlobStore):
    def __init__(self, tiers: Sequence[BlobStore], name: str = "tiered", max_partials: int = 64) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        formats = {t.kv_format for t in tiers}
        if len(formats) != 1:
            raise ValueError(f"all tiers must store one format, got {sorted(formats)}")
        prints = {t.fingerprint for t in tiers if t.fingerprint}
        if len(prints) > 1:
            raise ValueError(f"tiers disagree on the fingerprint: {sorted(prints)}")
        super().__init__(name, formats.pop(), prints.pop() if prints else "")
        self._tiers = list(tiers)
        self._lock = threading.Lock()
        self._partials: OrderedDict[str, _Partial] = OrderedDict()
        self._max_partials = max_partials
        self._stats = StoreStats(name=name, extra={"promotions": 0})

    @property
    def tiers(self) -> tuple[BlobStore, ...]:
        return tuple(self._tiers)

    def keys(self) -> list[str] | None:
        """Every key of every tier; None when a tier cannot list its own."""
        listed = [t.keys() for t in self._tiers]
        if any(k is None for k in listed):
            return None
        return sorted({k for keys in listed for k in keys})

    # ------------------------------------------------------------------ primitives
    def meta(self, key: str) -> ChunkMeta | None:
        for tier in self._tiers:
            m = tier.meta(key)
            if m is not None:
                return m
        return None

    def get_blob(self, key: str, layer: int) -> tuple[ChunkMeta, Blob] | None:
        staging = read_target()[0] is not None
        for i, tier in enumerate(self._tiers):
            got = tier.get_blob(key, layer)
            if got is not None:
                if i > 0 and any(t.can_hold(got[0].nbytes) for t in self._tiers[:i]):  # else promotion cannot succeed
                    own = tier.holds_blobs or not staging  # a tier's own buffer stays valid; staging slots are reused
                    self._collect(key, i, layer, got[0], got[1] if own else bytearray(got[1]))
                self._count(layer, hit=True)
                return got
        self._count(layer, hit=False)
        return None

    def in_memory(self, key: str) -> bool:
        """Whether the top tier that has the chunk holds it in memory."""
        for tier in self._tiers:
            if tier.meta(key) is not None:
                return tier.holds_blobs
        return False

    def count_staging(self, seconds: float) -> None:
        """Held blobs copied into staging come from a memory tier (the device tier's are not copied)."""
        for tier in self._tiers:
            if tier.kind == "memory":  # no stats snapshot: this runs once per layer
                tier.count_staging(seconds)
                return

    def open_files(self) -> OpenFiles:
        return OpenFiles(direct=any(t.direct_io for t in self._tiers))

    def put_blobs(self, key: str, meta: ChunkMeta, blobs: Sequence[Blob]) -> bool:
        return self._put_into(self._tiers, key, meta, blobs)

    def get_blobs(self, key: str) -> tuple[ChunkMeta, list[Blob]] | None:
        for i, tier in enumerate(self._tiers):
            got = tier.get_blobs(key)
            if got is not None:
                if i > 0:
                    self._promote(key, i, *got)
                self._count(0, hit=True)
                return got
        self._count(0, hit=False)
        return None

    # ------------------------------------------------------------------ promotion
    def _collect(self, key: str, source: int, layer: int, meta: ChunkMeta, blob: Blob) -> None:
        """Remember layers read from a lower tier; promote once every layer has been seen."""
        with self._lock:
            p = self._partials.get(key)
            if p is None or p.meta != meta or p.source != source:
                p = self._partials[key] = _Partial(meta, source, [None] * meta.n_layers)
                while len(self._partials) > self._max_partials:
                    self._partials.popitem(last=False)
            p.blobs[layer] = blob
            if any(b is None for b in p.blobs):
                return
            del self._partials[key]
        self._promote(key, source, meta, p.blobs)

    def complete_promotions(self, keys: Sequence[str], layers: Collection[int]) -> None:
        """Promote the chunks whose promotion waits only on `layers`, which a stream skipped (layers its
        consumer recomputes whole): read those from the tier that served the rest, outside any staging
        slot, after the stream's own reads."""
        for key in keys:
            with self._lock:
                p = self._partials.get(key)
                missing = [i for i, b in enumerate(p.blobs) if b is None] if p is not None else [None]
                if not set(missing) <= set(layers):
                    continue
                source, meta = p.source, p.meta
            for layer in missing:
                got = self.tiers[source].get_blob(key, layer)
                if got is None or got[0] != meta:
                    break
                self._collect(key, source, layer, meta, got[1])

    def _promote(self, key: str, source: int, meta: ChunkMeta, blobs: Sequence[Blob]) -> None:
        if self._put_into(self._tiers[:source], key, meta, blobs):
            with self._lock:
                self._stats.extra["promotions"] += 1

    def _put_into(self, tiers: Sequence[BlobStore], key: str, meta: ChunkMeta, blobs: Sequence[Blob]) -> bool:
        stored = False
        for tier in tiers:
            try:
                stored = tier.put_blobs(key, meta, blobs) or stored
            except OSError as exc:  # never fail a request because one tier could not store
                logger.warning("tier %s could not store %s: %s", tier.name, key, exc)
        if stored:
            with self._lock:
                self._stats.puts += 1
        else:
            with self._lock:
                self._stats.skipped_puts += 1
        return stored

    def _count(self, layer: int, hit: bool) -> None:
        if layer != 0:
            return
        with self._lock:
            if hit:
                self._stats.hits += 1
            else:
                self._stats.misses += 1

    # ------------------------------------------------------------------ KVStore
    def prefetch(self, keys: Sequence[str], files: OpenFiles | None = None) -> None:
        for tier in self._tiers:
            tier.prefetch(keys, files)

    def delete(self, key: str) -> bool:
        with self._lock:
            self._partials.pop(key, None)
        return any([tier.delete(key) for tier in self._tiers])

    def tier(self, name: str) -> BlobStore:
        for t in self._tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers: {[t.name for t in self._tiers]}")

    def stats(self) -> StoreStats:
        per_tier = [t.stats() for t in self._tiers]
        with self._lock:
            out = self._stats.snapshot()
        for field in _SUMMED:
            setattr(out, field, sum(getattr(s, field) for s in per_tier))
        out.extra["tiers"] = [s.as_dict() for s in per_tier]
        for s in per_tier:
            if "available" in s.extra:
                out.extra[f"{s.name}_available"] = s.extra["available"]
        return out

    def close(self) -> None:
        for tier in self._tiers:
            tier.close()
