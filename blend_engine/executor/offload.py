"""Copying a finished prefill's KV back to host memory, off the critical path (prefix_cache mode).

    cache k[l], v[l] [H, C, D]  --gather-->  one block [2, L, H, T, D] on the device
                                --one non-blocking copy-->  page-locked host memory

On CUDA the gather runs on the compute stream (a device copy, ordered before anything the stream
writes later: the cache is a run of the paged KV pool, whose blocks go to the next request as soon
as this one ends), and the copy to the host on the device's one save stream after it (a
device-side wait, no host sync), recording an event: the engine loop goes on decoding while the
copy runs, and whoever stores the entry waits for the event (`HostCopy.kv`) on its own thread. The
gathered block is marked in use by the save stream, so its memory is not reused before the copy
has read it. On the CPU the gather is the copy (plain memory) and is done on return. Shapes: L layers, H kv heads, T tokens,
D head dim.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from blend_engine.kv_store import ChunkKV
from blend_engine.kv_store.staging import pinnable
from blend_engine.transfer import cuda_ready

from .layers import KVCache


@functools.cache
def save_stream(device: torch.device) -> torch.cuda.Stream:
    """The one device-to-host stream of a CUDA device, shared by every engine and request on it
    (uploads have their own, `transfer.copy_stream`, so saves never queue behind loads)."""
    return torch.cuda.Stream(device)


@dataclass(frozen=True)
class HostCopy:
    """A segment's K/V on its way to host memory: block [2, L, H, T, D] (pinned on CUDA), `done`
    the event of its copy (None: already complete)."""

    block: torch.Tensor
    done: object | None = None

    def kv(self) -> ChunkKV:
        """The copied K/V [L, H, T, D] each, once the copy is complete (a host wait on its event only)."""
        if self.done is not None:
            self.done.synchronize()
        return ChunkKV(self.block[0], self.block[1])


def copy_to_host(cache: KVCache, start: int, end: int) -> HostCopy:
    """Positions start..end-1 of every layer's K and V: one non-blocking copy to host memory."""
    device = cache.k[0].device
    if device.type == "cpu":
        return HostCopy(_gather(cache, start, end))  # [2, L, H, T, D], a copy
    stream = save_stream(device) if cuda_ready(device) else None
    block = _gather(cache, start, end)  # [2, L, H, T, D] on the device, on the compute stream
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))  # after the gather
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        host = torch.empty(block.shape, dtype=block.dtype, pin_memory=pinnable())  # [2, L, H, T, D]
        host.copy_(block, non_blocking=True)
    if stream is None:  # another device (or a stand-in): the copy is done
        return HostCopy(host)
    block.record_stream(stream)  # not reused before the save stream has read it
    event = torch.cuda.Event()
    event.record(stream)
    return HostCopy(host, event)


def _gather(cache: KVCache, start: int, end: int) -> torch.Tensor:
    """Every layer's K and V at positions start..end-1 as one block [2, L, H, T, D], where the cache is."""
    return torch.stack([torch.stack([layer[:, start:end] for layer in part]) for part in (cache.k, cache.v)])
