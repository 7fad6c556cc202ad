"""Host staging buffers: where one layer of a request's cached chunks lands on its way to the device.

A `StagingSlot` is one contiguous uint8 buffer (pinned where CUDA exists) with an aligned region
per chunk, so the disk tier reads each chunk's layer blob (its K and V, one slab) straight into
it, and a device gets the whole layer in one host-to-device copy. Each region starts on a 4 KiB
boundary and has 4 KiB of slack at the end, so an O_DIRECT read of the aligned span around the
blob fits too (`chunkfile.read_into`). A `StagingRing` hands slots out round-robin and, before it
reuses one, waits for the fence its consumer set (the copy out of it) and drops what it held.

`StagedLayer` is what the loader yields for one layer: each chunk's verified blob, either a view
of its region or, for a tier that already holds the bytes (the memory tier), the tier's own
buffer, which needs no host copy at all.

The loader tells the tiers where to read with `reading_into(region, files)` around its
`get_blob` call (a per-thread read target, so `get_blob` stays the one read primitive every tier,
wrapper and test double implements): a tier that copies bytes from elsewhere (the disk) reads
into the region through `files`, the stream's open descriptors (`chunkfile.OpenFiles`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from blend_engine.kv_store.codec import ChunkMeta, decode_layer

ALIGN = 4096
_target = threading.local()


class reading_into:  # noqa: N801 - used as a context manager, like contextlib's
    """Within the block, this thread's `get_blob` calls read into `region` through `files`.
    (A class, not a generator: it runs once per chunk and layer.)"""

    __slots__ = ("_target",)

    def __init__(self, region: memoryview, files) -> None:
        self._target = (region, files)

    def __enter__(self) -> None:
        _target.value = self._target

    def __exit__(self, *exc) -> None:
        _target.value = None


def read_target() -> tuple[memoryview | None, object | None]:
    """(region, open files) this thread reads into now; (None, None) outside `reading_into`."""
    return getattr(_target, "value", None) or (None, None)


def region_size(nbytes: int) -> int:
    """Bytes a region reserves for a blob of `nbytes`: aligned, plus room for an aligned read's head."""
    return -(-nbytes // ALIGN) * ALIGN + ALIGN


@functools.cache
def pinnable() -> bool:
    """Page-locked host memory is worth allocating only where a CUDA device will copy from it."""
    return torch.cuda.is_available()


def address(buf) -> int:
    """The address of a bytes-like object's first byte."""
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0] if len(buf) else 0


def is_pinned(blob) -> bool:
    """Whether a bytes-like object lives in page-locked memory (never, without CUDA)."""
    return pinnable() and torch.frombuffer(blob, dtype=torch.uint8).is_pinned()


class StagingSlot:
    """One layer's staging buffer: region i (at `offsets[i]`, 4 KiB aligned) is chunk i's."""

    def __init__(self, sizes: Sequence[int], pinned: bool) -> None:
        self.sizes = tuple(sizes)
        self.offsets: list[int] = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += region_size(n)
        raw = torch.empty(total + ALIGN, dtype=torch.uint8, pin_memory=pinned)  # [bytes], aligned below
        start = -raw.data_ptr() % ALIGN
        self.buf = raw[start:start + total]  # [bytes]
        self._view = memoryview(self.buf.numpy())
        self.fence: object | None = None  # e.g. a torch.cuda.Event: the copy out of this slot
        self.held: list[object] = []  # buffers that must outlive the copy (a tier's own pinned blobs)

    def region(self, i: int) -> memoryview:
        """Chunk i's writable region (`region_size` bytes, 4 KiB aligned)."""
        o = self.offsets[i]
        return self._view[o:o + region_size(self.sizes[i])]

    def adopt(self, i: int, blob):
        """Chunk i's blob as the consumer should get it: a tier's pageable buffer copied into the
        region (by the reader thread that read it); a view of this slot or pinned memory as is."""
        if self.offset_of(blob) is not None or is_pinned(blob):
            return blob
        region = self.region(i)
        region[:len(blob)] = blob
        return region[:len(blob)]

    def offset_of(self, blob) -> int | None:
        """Where a blob lies in this slot's buffer; None when it is another buffer."""
        o = address(blob) - self.buf.data_ptr()
        return o if 0 <= o and o + len(blob) <= self.buf.numel() else None

    def reuse(self) -> None:
        """Wait until the consumer's copy out of this slot is done, then forget what it held."""
        if self.fence is not None:
            self.fence.synchronize()
        self.fence = None
        self.held.clear()


class StagingRing:
    """`slots` staging slots reused round-robin (allocated again when the chunk sizes change).
    `gather`: the reader threads copy a tier's pageable buffers into the slot as they read them
    (for a consumer that uploads the slot in one copy); otherwise those are handed over as they are.

    Not thread-safe: one producer (the loader's reader thread) asks for slots."""

    def __init__(self, slots: int, pinned: bool | None = None, gather: bool = False) -> None:
        self.pinned = pinnable() if pinned is None else pinned
        self.gather = gather
        self._n = max(1, slots)
        self._slots: list[StagingSlot] = []
        self._next = 0

    def next(self, sizes: Sequence[int]) -> StagingSlot:
        """The next slot, for chunks whose layer blobs have these sizes, free to overwrite."""
        if not self._slots or self._slots[0].sizes != tuple(sizes):
            for s in self._slots:
                s.reuse()
            self._slots = [StagingSlot(sizes, self.pinned) for _ in range(self._n)]
        slot = self._slots[self._next % self._n]
        self._next += 1
        slot.reuse()
        return slot


@dataclass(frozen=True)
class StagedLayer:
    """One layer of a request's cached chunks: per chunk its meta and verified layer blob (a view of
    `slot`, or a tier's own buffer). Valid until the slot is handed out again."""

    layer: int
    metas: tuple[ChunkMeta, ...]
    blobs: tuple[object, ...]  # bytes-like, each metas[i].layer_nbytes long
    slot: StagingSlot

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs)

    def decoded(self, quantized: bool):
        """The chunks as (k, v) [H, T, D] views (or int8 `QuantLayer`s with `quantized`), no copy."""
        return [decode_layer(m, b, quantized=quantized) for m, b in zip(self.metas, self.blobs)]

    def gather(self) -> tuple[list[int], list[tuple[int, torch.Tensor]], int]:
        """Bring every blob into the slot's layout, for one copy of the slot: a tier's pageable
        buffer is copied into its region here; one in pinned memory is left where it is (it gets its
        own copy, and the slot holds it until then). Returns (each blob's offset in the slot's
        layout, the pinned (offset, uint8 tensor) pairs, bytes of the slot the blobs there use)."""
        at, pinned, used = [], [], 0
        for i, blob in enumerate(self.blobs):
            if is_pinned(blob) and self.slot.offset_of(blob) is None:  # a tier's own pinned buffer
                pinned.append((self.slot.offsets[i], torch.frombuffer(blob, dtype=torch.uint8)))  # [bytes]
                self.slot.held.append(blob)
                at.append(self.slot.offsets[i])
                continue
            o = self.slot.offset_of(self.slot.adopt(i, blob))
            at.append(o)
            used = max(used, o + len(blob))
        return at, pinned, used
