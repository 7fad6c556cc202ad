"""Layer-wise loading: the engine consumes one layer of every chunk at a time.

`LayerStream` is an iterator over layers; each item is the list of (k, v) [H, T, D] for the
requested chunks in order, or, given a `pack` callable (the engine's `transfer.LayerPacker`),
whatever it makes of that list: packing runs on the reader thread, off the critical path.
With `stored=True` an int8 store's layers come as read (`codec.QuantLayer`, not dequantized),
for a consumer that moves them as int8 and dequantizes on its device.
`PrefetchStream` reads layers i+1.. on a background thread while the engine computes layer i
(bounded read-ahead); `LayerStream` reads synchronously. Either way a missing or corrupt chunk
is recomputed through `repair(key)`, stored again, and counted.

Staged reads: when the pack callable has a `staging` ring (`staging.StagingRing`, the engine's
packer does) and the store is a `BlobStore`, each layer is read into the ring's next slot: every
chunk's layer blob lands in its region by one read (the disk tier; `get_blob` inside
`staging.reading_into`) or stays in the tier's own buffer (the memory tier), verified, and the
item handed to `pack` is a `staging.StagedLayer`.
Per layer, the chunks a tier holds in memory (`held_blob`) are taken on the stream's own thread in
one pass (copied into the slot when the consumer gathers: one memcpy each, no pool round trip per
blob), while the others are read `READERS` at a time (the stream's thread and the pool's; the
reads and checksums release the GIL), through descriptors opened once per stream.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from blend_engine.kv_store.base import ChunkKV, KVStore
from blend_engine.kv_store.codec import FORMATS, ChunkMeta, QuantLayer, decode_layer, encode_chunk
from blend_engine.kv_store.staging import StagedLayer, StagingRing, StagingSlot, reading_into
from blend_engine.model.cpu_threads import one_core

logger = logging.getLogger(__name__)
Repair = Callable[[str], ChunkKV]
LayerKV = list[tuple[torch.Tensor, torch.Tensor] | QuantLayer]
Pack = Callable[[LayerKV], object]
READERS = 4  # chunk reads in flight per layer
CUDA_PREFETCH_DEPTH = 2  # layers read ahead by default where CUDA exists: the copy of i+1 overlaps layer i


def default_prefetch_depth() -> int:
    """`CUDA_PREFETCH_DEPTH` where a CUDA device exists, else 0 (the CPU reads synchronously: no copy to overlap)."""
    return CUDA_PREFETCH_DEPTH if torch.cuda.is_available() else 0


@functools.cache
def reader_pool() -> ThreadPoolExecutor:
    """The process's chunk readers, shared by every stream (threads start on first use), on one core
    each: the engine loop is the thread that computes on every core (`cpu_threads`)."""
    return ThreadPoolExecutor(READERS, thread_name_prefix="kv-read", initializer=one_core)


@dataclass
class LoadTrace:
    """Per-layer timings of one stream: load time (the read into staging, the copy of held blobs
    into it, and the pack and upload start: the whole path on the reader's side), and how long the
    consumer waited for it."""

    read_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    held_s: list[float] = field(default_factory=list)  # staged streams: copying held blobs into the slot
    repaired: list[str] = field(default_factory=list)


class LayerStream:
    """Synchronous stream: reads layer i when the engine asks for it (no overlap)."""

    def __init__(self, store: KVStore, keys: Sequence[str], n_layers: int, repair: Repair,
                 pack: Pack | None = None, stored: bool = False, skip: Collection[int] = ()) -> None:
        self._store = store
        self._skip = frozenset(skip)  # layers the consumer recomputes whole: yielded as None, never read
        self._pack = pack
        self._stored = stored
        self._keys = list(keys)
        self._n_layers = n_layers
        self._repair = repair
        self._fixed: dict[str, ChunkKV | tuple[ChunkMeta, list[bytearray]]] = {}
        self.trace = LoadTrace()
        ring = getattr(pack, "staging", None)
        self._ring: StagingRing | None = ring if store.blob_level and isinstance(ring, StagingRing) else None
        self._files = store.open_files() if self._ring is not None else None
        self._metas: list[ChunkMeta] | None = None
        self._held: list[bool] | None = None  # per chunk: served from memory (asked once, at layer 0)

    def _fix(self, key: str) -> None:
        """Recompute a chunk from its text, store it again, and use it as the store would return it."""
        kv = self._repair(key)
        self._store.put(key, kv)
        fmt = self._store.kv_format
        self._fixed[key] = encode_chunk(fmt, kv) if fmt in FORMATS else kv  # a later cached load's values
        self.trace.repaired.append(key)

    def _fixed_layer(self, key: str, layer: int):
        fixed = self._fixed[key]
        if isinstance(fixed, ChunkKV):
            return fixed.layer(layer)  # [H, T, D] each
        meta, blobs = fixed
        return decode_layer(meta, blobs[layer], quantized=self._stored)

    def _get(self, key: str, layer: int):
        if self._stored:
            return self._store.get_layer_stored(key, layer)
        return self._store.get_layer(key, layer)

    def _read(self, layer: int) -> LayerKV | StagedLayer:
        if self._ring is not None:
            return self._read_staged(layer)
        out: LayerKV = []
        for key in self._keys:
            got = self._fixed_layer(key, layer) if key in self._fixed else self._get(key, layer)
            if got is None:  # missing or corrupt mid-stream: recompute from text, re-store, go on
                self._fix(key)
                got = self._fixed_layer(key, layer)
            out.append(got)
        return out

    # ------------------------------------------------------------------ staged reads
    def _read_staged(self, layer: int) -> StagedLayer:
        """Every chunk's layer blob into its region of the next staging slot (or the tier's own
        buffer). Chunks a tier holds in memory are taken on this thread, in one pass, while the
        others are read `READERS` at a time on the pool; a missing or corrupt chunk is repaired
        afterwards, here."""
        if self._metas is None:
            self._metas = [self._stored_meta(key) for key in self._keys]
        slot = self._ring.next([m.layer_nbytes for m in self._metas])
        if self._held is None:
            self._held = [self._store.in_memory(key) for key in self._keys]  # once per stream
        got: list[tuple[ChunkMeta, object] | None] = [None] * len(self._keys)
        held = [i for i, key in enumerate(self._keys) if self._held[i] and key not in self._fixed]
        rest = [i for i, key in enumerate(self._keys) if not self._held[i] or key in self._fixed]
        k = min(READERS, len(rest))
        groups = [rest[len(rest) * g // k:len(rest) * (g + 1) // k] for g in range(k)]
        pending = [reader_pool().submit(self._read_group, layer, g, slot) for g in groups[1:]]  # in flight...
        t0 = time.perf_counter()
        for i in held:  # ...while the chunks held in memory are taken (and copied in) here, in one pass
            with reading_into(slot.region(i), self._files):
                got[i] = self._checked(self._store.get_blob(self._keys[i], layer), i, slot)
        self.trace.held_s.append(time.perf_counter() - t0)
        if self._ring.gather and any(x is not None and not isinstance(x[1], torch.Tensor) for x in got):
            self._store.count_staging(self.trace.held_s[-1])  # the memory tier's delivery: its copy into staging
        parts = [(groups[0], self._read_group(layer, groups[0], slot))] if groups else []
        parts += [(g, f.result()) for g, f in zip(groups[1:], pending)]
        for g, part in parts:
            for i, x in zip(g, part):
                got[i] = x
        for i, key in enumerate(self._keys):
            if got[i] is None:  # missing or corrupt mid-stream: recompute from text, re-store, go on
                self._fix(key)
                got[i] = self._fixed_blob(key, layer)
        return StagedLayer(layer, tuple(m for m, _ in got), tuple(b for _, b in got), slot)

    def _checked(self, got: tuple[ChunkMeta, object] | None, i: int, slot: StagingSlot):
        """A tier's answer for chunk i: None when it does not fit its region; else (meta, blob),
        the blob copied into the slot when the consumer gathers (a device tier's stays where it is)."""
        if got is None or got[0].layer_nbytes != slot.sizes[i] or len(got[1]) != slot.sizes[i]:
            return None
        if not self._ring.gather or isinstance(got[1], torch.Tensor):
            return got
        return got[0], slot.adopt(i, got[1])

    def _read_group(self, layer: int, chunks: Sequence[int], slot: StagingSlot) -> list[tuple[ChunkMeta, object] | None]:
        out: list[tuple[ChunkMeta, object] | None] = []
        for i in chunks:
            key = self._keys[i]
            if key in self._fixed:
                out.append(self._fixed_blob(key, layer))
                continue
            with reading_into(slot.region(i), self._files):
                got = self._store.get_blob(key, layer)
            out.append(self._checked(got, i, slot))
        return out

    def _stored_meta(self, key: str) -> ChunkMeta:
        """The chunk's meta (its layer size sizes the staging); a chunk already gone is repaired now."""
        meta = self._store.meta(key)
        if meta is None:
            self._fix(key)
            meta = self._fixed[key][0]
        return meta

    def _fixed_blob(self, key: str, layer: int) -> tuple[ChunkMeta, bytearray]:
        meta, blobs = self._fixed[key]
        return meta, blobs[layer]

    def _finish(self) -> None:
        """Close the descriptors; report the packer's uploads of this stream to the store."""
        if self._files is not None:
            self._files.close()
        totals = getattr(self._pack, "upload_totals", None)
        if self._ring is not None and totals is not None:
            nbytes, seconds = totals()
            if nbytes:
                self._store.count_upload(nbytes, seconds)  # the last leg of the path, for the controller

    # ------------------------------------------------------------------ iteration
    def _load(self, layer: int) -> object | None:
        """Layer `layer` read and packed; None for a skipped layer (nothing read, no slot used)."""
        if layer in self._skip:
            return None
        item = self._read(layer)
        return self._pack(item) if self._pack is not None else item

    def __iter__(self) -> Iterator[LayerKV | None]:
        for layer in range(self._n_layers):
            t0 = time.perf_counter()
            item = self._load(layer)
            read = time.perf_counter() - t0
            self.trace.read_s.append(read)
            self.trace.wait_s.append(read)
            yield item

    def _complete_promotions(self) -> None:
        """A tiered store promotes a chunk once every layer has passed: read the skipped ones now."""
        complete = getattr(self._store, "complete_promotions", None)
        if self._skip and complete is not None:
            complete(self._keys, self._skip)

    def close(self) -> None:
        self._complete_promotions()
        self._finish()


class PrefetchStream(LayerStream):
    """Reads ahead on a background thread, at most `depth` layers beyond what was consumed.

    trace.read_s[i]: time the reader spent on layer i; trace.wait_s[i]: time the consumer blocked
    for it. Reader errors are raised in the consumer. `close()` stops and joins the reader.
    """

    def __init__(self, store: KVStore, keys: Sequence[str], n_layers: int, repair: Repair, depth: int,
                 pack: Pack | None = None, stored: bool = False, skip: Collection[int] = ()) -> None:
        super().__init__(store, keys, n_layers, repair, pack, stored, skip)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="kv-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        one_core()  # not a compute thread (`cpu_threads`)
        try:
            if self._files is not None:
                self._store.prefetch(self._keys, self._files)  # opens each file once, for the stream
            else:
                self._store.prefetch(self._keys)
            for layer in range(self._n_layers):
                if self._stop.is_set():
                    return
                t0 = time.perf_counter()
                item = self._load(layer)
                self.trace.read_s.append(time.perf_counter() - t0)
                self._offer((item, None))
            self._complete_promotions()  # here, on the reader thread, after the last layer
        except BaseException as exc:  # handed to the consumer, raised there
            self._offer((None, exc))

    def _offer(self, msg: tuple) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(msg, timeout=0.05)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[LayerKV]:
        for _ in range(self._n_layers):
            t0 = time.perf_counter()
            item, exc = self._queue.get()
            self.trace.wait_s.append(time.perf_counter() - t0)
            if exc is not None:
                raise exc
            yield item

    def close(self) -> None:
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()
        self._finish()


class LayerLoader:
    """Opens layer streams on a store; prefetch_depth 0 reads synchronously, None (the default)
    means `default_prefetch_depth()`: 2 where CUDA exists, else 0."""

    def __init__(self, store: KVStore, prefetch_depth: int | None = None) -> None:
        prefetch_depth = default_prefetch_depth() if prefetch_depth is None else prefetch_depth
        if prefetch_depth < 0:
            raise ValueError("prefetch_depth must be >= 0")
        self.store = store
        self.prefetch_depth = prefetch_depth

    def stream(self, keys: Sequence[str], n_layers: int, repair: Repair, pack: Pack | None = None,
               stored: bool = False, skip: Collection[int] = ()) -> LayerStream:
        """`pack` turns each layer's chunk list into the item yielded (run where the read runs);
        `stored`: layers as stored (int8 not dequantized, see the module doc); `skip`: layers the
        consumer recomputes whole (a blend's layers below its check layer), yielded as None unread."""
        if self.prefetch_depth == 0:
            return LayerStream(self.store, keys, n_layers, repair, pack, stored, skip)
        return PrefetchStream(self.store, keys, n_layers, repair, self.prefetch_depth, pack, stored, skip)
