"""Device tier: the hottest chunks kept in the model's device memory, above the pinned memory tier.

A hit here needs no host-to-device copy at all: a layer stream gets each layer's blob as a uint8
view of the chunk's one device tensor (`get_blob` inside `staging.reading_into`), and the engine's packer decodes and
concatenates it where it lies (`transfer.LayerPacker`), next to the chunks it did upload.

What lives here follows LMCache's hot-cache rules: a chunk is written through on store (it was just
computed, so it is hot), a chunk served by a lower tier is promoted up once its layers have passed
(`TieredStore`), and the tier evicts least recently used chunks by bytes. Blobs are views of the
stored tensor: callers must not modify them. Outside a layer stream (`get`, `get_layer`), `get_blob`
copies the layer back to the host.

The tier takes a `device` argument so its bookkeeping runs anywhere: "cpu" (tests: real bytes),
"meta" (no bytes at all: budgets and eviction only), "cuda:N" (the service).

Budget (`device_cache_bytes`, setting BLENDSERVE_DEVICE_CACHE_GB): unset means automatic, which is
0 (no tier) off CUDA and `AUTO_FRACTION` of the device memory free once the model is loaded, less the
running batch's KV budget, on CUDA. An explicit value is used as is; a negative, non-finite value, a
positive one on a device that is not CUDA, or more than the device has free fails at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend_engine.kv_store.blob import Blob
from blend_engine.kv_store.codec import ChunkMeta
from blend_engine.kv_store.held import HeldTier
from blend_engine.kv_store.staging import read_target

AUTO_FRACTION = 0.2  # of the free device memory after the model is loaded and the batch's KV set aside


def device_cache_bytes(gb: float | None, device: torch.device | str, reserved_bytes: int = 0,
                       free_bytes: int | None = None) -> int:
    """The device tier's budget in bytes: `gb` (GB = 2**30 bytes) when given, else automatic (see the
    module doc). `reserved_bytes`: device memory the engine needs besides the model (the running
    batch's KV). `free_bytes`: the device's free memory (measured when None). Raises ValueError on a
    value the device cannot honour."""
    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if gb is not None and (not math.isfinite(gb) or gb < 0):
        raise ValueError(f"BLENDSERVE_DEVICE_CACHE_GB must be a finite number >= 0, got {gb}")
    if gb is None and not cuda:
        return 0
    if gb is not None and gb > 0 and not cuda:
        raise ValueError(f"BLENDSERVE_DEVICE_CACHE_GB={gb} needs a CUDA device; the engine runs on {device} "
                         "(its memory tier already holds the chunks there)")
    if gb == 0:
        return 0
    free = torch.cuda.mem_get_info(device)[0] if free_bytes is None else free_bytes
    if gb is None:
        return max(0, int(AUTO_FRACTION * (free - reserved_bytes)))
    want = int(gb * (1 << 30))
    if want + reserved_bytes > free:
        raise ValueError(f"BLENDSERVE_DEVICE_CACHE_GB={gb} ({want >> 20} MiB) plus the batch's KV "
                         f"({reserved_bytes >> 20} MiB) is more than the {free >> 20} MiB free on {device}")
    return want


def _host_view(blob: Blob | torch.Tensor) -> torch.Tensor:
    """A blob as a uint8 tensor [n] over the same memory (no copy)."""
    return blob if isinstance(blob, torch.Tensor) else torch.frombuffer(blob, dtype=torch.uint8)  # [n]


@dataclass
class _Entry:
    meta: ChunkMeta
    data: torch.Tensor  # [L * layer_nbytes] uint8 on the tier's device


class DeviceStore(HeldTier):
    evict_before_hold = True  # the device memory is freed before the new chunk takes it

    def __init__(self, budget_bytes: int, device: torch.device | str, kv_format: str = "fp16",
                 name: str = "device", fingerprint: str = "") -> None:
        if budget_bytes < 0:
            raise ValueError(f"device tier budget must be >= 0 bytes, got {budget_bytes}")
        super().__init__(name, kv_format, fingerprint, budget_bytes, kind="device")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._copies = torch.cuda.Stream(self.device) if self._cuda else None

    def _hold(self, meta: ChunkMeta, blobs: Sequence[Blob]) -> _Entry:
        return _Entry(meta, self._upload(meta, blobs))

    def _upload(self, meta: ChunkMeta, blobs: Sequence[Blob]) -> torch.Tensor:
        """The chunk's blobs in one device tensor [L * layer_nbytes], the copy finished (a put is off
        the critical path: a store after compute, or a promotion after the stream's last layer).

        On CUDA the copies run on the tier's copy stream, ordered on both sides: the copy stream
        first waits for the current (compute) stream, whose pool the new tensor came from (its
        memory may still be read by kernels queued there); then an event recorded on the copy
        stream, after the copies, is waited for by the compute stream (device side) and by this
        thread (the host buffers, `frombuffer` views that the allocator does not track, are read
        until then)."""
        n = meta.layer_nbytes
        data = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)  # [L * n]
        if self.device.type == "meta":
            return data
        if not self._cuda:
            for i, b in enumerate(blobs):
                data[i * n:(i + 1) * n].copy_(_host_view(b))  # [n]
            return data
        compute = torch.cuda.current_stream(self.device)
        self._copies.wait_stream(compute)  # the allocation may reuse memory the compute stream still reads
        with torch.cuda.stream(self._copies):
            for i, b in enumerate(blobs):
                data[i * n:(i + 1) * n].copy_(_host_view(b), non_blocking=True)  # [n], async from pinned memory
            done = torch.cuda.Event()
            done.record(self._copies)  # on the copy stream, after its copies
        data.record_stream(self._copies)  # written there: freed only after the copy stream is done with it
        compute.wait_event(done)  # the compute stream reads the chunk only after its copy
        done.synchronize()  # the host buffers (`blobs`) are read until here: only then may the caller free them
        return data

    def get_blob(self, key: str, layer: int) -> tuple[ChunkMeta, Blob | torch.Tensor] | None:
        """In a layer stream (`staging.reading_into`): the layer as a uint8 view [layer_nbytes] of the
        chunk's device tensor, left where it is. Elsewhere (the unstaged read): copied to the host."""
        e = self._served(key, layer)
        if e is None:
            return None
        n = e.meta.layer_nbytes
        view = e.data[layer * n:(layer + 1) * n]  # [n] uint8 on the device
        if read_target()[0] is not None:
            return e.meta, view
        return e.meta, bytearray(view.cpu().numpy())

