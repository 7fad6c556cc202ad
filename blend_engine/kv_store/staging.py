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

Slot memory outlives its ring: a request's packer makes a new ring, and fresh memory costs a page
fault per 4 KiB on first touch (on this machine that halved the memory tier's delivery rate) and,
pinned, a driver call. A slot takes its buffer from `host_buffers()`, a process-wide free list,
and gives it back when it is collected (after its last copy out has finished).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from blend_engine.kv_store.codec import ChunkMeta, decode_layer, decode_raw

ALIGN = 4096
KEEP_BYTES = 1 << 30  # free staging memory kept for the next rings (pinned on CUDA)
_GRAIN = 1 << 20  # slot buffers are allocated in whole MiB, so similar requests share them
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
    """The address of a bytes-like object's first byte (ctypes for a writable one: 5x cheaper than numpy's)."""
    if not len(buf):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except TypeError:  # read-only
        return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


def is_pinned(blob) -> bool:
    """Whether a bytes-like object lives in page-locked memory (never, without CUDA)."""
    return pinnable() and torch.frombuffer(blob, dtype=torch.uint8).is_pinned()


class _Lease:
    """A slot's buffer, the fence of the last copy out of it, and the other host buffers that copy
    reads (a tier's pinned blobs, `held`): all handed back together, so a slot collected while its
    last copy is in flight keeps those buffers alive until the fence has passed."""

    __slots__ = ("raw", "pinned", "fence", "held")

    def __init__(self, raw: torch.Tensor, pinned: bool) -> None:
        self.raw = raw
        self.pinned = pinned
        self.fence: object | None = None
        self.held: list[object] = []

    def settle(self) -> None:
        """Wait for the last copy out of this buffer (and out of `held`), then let go of `held`."""
        if self.fence is not None:
            self.fence.synchronize()
            self.fence = None
        self.held.clear()


class HostBuffers:
    """Free staging buffers, reused by the next slots instead of allocating (and faulting in, or
    pinning) fresh memory per request. Keeps at most `keep_bytes`, dropping the oldest. Thread-safe.

    Buffers come back from slots' finalizers, which the garbage collector runs inside whatever
    allocation triggered it, on any thread, also one that holds this object's lock (`take` allocates
    under it): so `give` only queues the buffer (a deque's append needs no lock) and the next call
    under the lock files what was queued."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: list[_Lease] = []
        self._returned: collections.deque[_Lease] = collections.deque()  # given back, not filed yet
        self.allocated = 0  # buffers made (a counter for tests and stats)

    def take(self, nbytes: int, pinned: bool) -> _Lease:
        """A buffer of at least `nbytes` (and at most twice that, so a big one is not wasted on a
        small slot), free to overwrite."""
        with self._lock:
            dropped = self._file_returned()
            fits = [x for x in self._free if x.pinned == pinned and nbytes <= x.raw.numel() <= 2 * nbytes + _GRAIN]
            lease = min(fits, key=lambda x: x.raw.numel()) if fits else None
            if lease is not None:
                self._free.remove(lease)
            else:
                self.allocated += 1
        _settle(dropped)
        if lease is None:
            raw = torch.empty(-(-nbytes // _GRAIN) * _GRAIN, dtype=torch.uint8, pin_memory=pinned)  # [bytes]
            return _Lease(raw, pinned)
        lease.settle()  # the last copy out of it (and of what it held) is done
        return lease

    def give(self, lease: _Lease) -> None:
        """Take a buffer back; its fence and held buffers come with it (settled when it is reused,
        or when it is dropped for room). Never blocks: safe in a finalizer."""
        self._returned.append(lease)

    def _file_returned(self) -> list[_Lease]:
        """Under the lock: the buffers given back join the free ones; those dropped for room (the
        oldest first), to settle outside the lock."""
        while self._returned:
            self._free.append(self._returned.popleft())
        dropped = []
        total = sum(x.raw.numel() for x in self._free)
        while total > self.keep_bytes:
            dropped.append(self._free.pop(0))
            total -= dropped[-1].raw.numel()
        return dropped

    def free_bytes(self) -> int:
        with self._lock:
            dropped = self._file_returned()
            free = sum(x.raw.numel() for x in self._free)
        _settle(dropped)
        return free


def _settle(dropped: list[_Lease]) -> None:
    for old in dropped:
        old.settle()  # freed only once no copy reads it


@functools.cache
def host_buffers() -> HostBuffers:
    """The process's free staging buffers."""
    return HostBuffers()


class StagingSlot:
    """One layer's staging buffer: region i (at `offsets[i]`, 4 KiB aligned) is chunk i's. Its
    memory comes from `buffers` and goes back there when the slot is collected."""

    def __init__(self, sizes: Sequence[int], pinned: bool, buffers: HostBuffers | None = None) -> None:
        self.sizes = tuple(sizes)
        self.offsets: list[int] = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += region_size(n)
        buffers = buffers or host_buffers()
        self._lease = buffers.take(total + ALIGN, pinned)
        weakref.finalize(self, buffers.give, self._lease)
        raw = self._lease.raw  # [bytes], aligned below
        start = -raw.data_ptr() % ALIGN
        self.buf = raw[start:start + total]  # [bytes]
        self._array = self.buf.numpy()  # [bytes]
        self._view = memoryview(self._array)

    @property
    def held(self) -> list[object]:
        """Buffers that must outlive the copy out of this slot (a tier's own pinned blobs): kept by
        the lease, so they outlive the slot too while that copy is in flight."""
        return self._lease.held

    @property
    def fence(self) -> object | None:
        """E.g. a torch.cuda.Event: the copy out of this slot (the buffer is reused only after it)."""
        return self._lease.fence

    @fence.setter
    def fence(self, event: object | None) -> None:
        self._lease.fence = event

    def region(self, i: int) -> memoryview:
        """Chunk i's writable region (`region_size` bytes, 4 KiB aligned)."""
        o = self.offsets[i]
        return self._view[o:o + region_size(self.sizes[i])]

    def adopt(self, i: int, blob):
        """Chunk i's blob as the consumer should get it: a tier's pageable buffer copied into the
        region (by the reader thread that read it); a view of this slot or pinned memory as is."""
        if self.offset_of(blob) is not None or is_pinned(blob):
            return blob
        return self.copy_in(i, blob)

    def copy_in(self, i: int, blob) -> memoryview:
        """Copy a blob into chunk i's region (one memcpy, the GIL released); the region's view of it."""
        n = len(blob)
        o = self.offsets[i]
        np.copyto(self._array[o:o + n], np.frombuffer(blob, dtype=np.uint8))  # [n bytes]
        return self._view[o:o + n]

    def offset_of(self, blob) -> int | None:
        """Where a blob lies in this slot's buffer; None when it is another buffer."""
        o = address(blob) - self.buf.data_ptr()
        return o if 0 <= o and o + len(blob) <= self.buf.numel() else None

    def reuse(self) -> None:
        """Wait until the consumer's copy out of this slot is done, then forget what it held."""
        self._lease.settle()


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
            self._slots = []  # their buffers go back to the free list first, for the new slots
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
    blobs: tuple[object, ...]  # bytes-like (or a device tier's uint8 tensor), each metas[i].layer_nbytes long
    slot: StagingSlot

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs)

    def decoded(self, quantized: bool):
        """The chunks as (k, v) [H, T, D] views (or int8 `QuantLayer`s with `quantized`), no copy."""
        return [decode_raw(m, b, quantized=quantized) if isinstance(b, torch.Tensor) else
                decode_layer(m, b, quantized=quantized) for m, b in zip(self.metas, self.blobs)]

    def gather(self) -> tuple[list[int | None], list[tuple[int, torch.Tensor]], list[tuple[int, int]]]:
        """Bring every blob into the slot's layout, for as few copies of the slot as can be: a tier's
        pageable buffer is copied into its region here; one in pinned memory is left where it is (it
        gets its own copy, and the slot holds it until then); a device tier's (a tensor) needs no
        copy. Returns (each blob's offset in the slot's layout, None for those on the device; the
        pinned (offset, uint8 tensor) pairs; the (start, end) spans of the slot to copy: one per run
        of neighbouring chunks whose blobs are in the slot, so the regions of chunks that need no
        copy from it are skipped)."""
        at: list[int | None] = []
        pinned: list[tuple[int, torch.Tensor]] = []
        runs: list[tuple[int, int]] = []
        run_open = False
        for i, blob in enumerate(self.blobs):
            o = None if isinstance(blob, torch.Tensor) else self.slot.offset_of(blob)
            if isinstance(blob, torch.Tensor):  # already on the device
                at.append(None)
            elif o is None and is_pinned(blob):  # a tier's own pinned buffer
                pinned.append((self.slot.offsets[i], torch.frombuffer(blob, dtype=torch.uint8)))  # [bytes]
                self.slot.held.append(blob)
                at.append(self.slot.offsets[i])
            else:
                if o is None:  # a tier's pageable buffer
                    self.slot.copy_in(i, blob)
                    o = self.slot.offsets[i]
                at.append(o)
                if run_open:
                    runs[-1] = (runs[-1][0], o + len(blob))
                else:
                    runs.append((o, o + len(blob)))
                run_open = True
                continue
            run_open = False
        return at, pinned, runs
