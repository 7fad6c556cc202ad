"""Uploads of the executor's small host-built tensors: token ids, positions, index tensors.

Each goes to the device from page-locked memory with `non_blocking`: CUDA synchronises the stream
before a blocking copy, and before any copy from pageable memory, so either would make the host
wait for everything queued (a whole prefill, the previous decode step). A prefill builds its
tensors once per request, before the layer loop; the decode step uploads its ids and positions
once per step; nothing is uploaded per layer. The copy is ordered on the current stream before
every kernel that reads it, and the caching host allocator keeps the pinned source alive until
the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from blend_engine.kv_store.staging import pinnable


def pinned(host: torch.Tensor) -> torch.Tensor:
    """`host` in page-locked memory where CUDA exists (the only place it exists): the one place
    the executor pins its uploads (the fake-device test swaps it to see which sources were)."""
    return host.pin_memory() if pinnable() else host


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: pinned and non-blocking there, the tensor itself on the CPU."""
    if device.type == "cpu":
        return host
    return pinned(host).to(device, non_blocking=True)


def upload_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A host list of ints as a long tensor on `device` [n] (see `upload`)."""
    return upload(torch.tensor(list(values), dtype=torch.long), device)  # [n]


def span_ranges(spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Every position of the integer spans [start, end), in order, as a host long tensor [S]: built
    by numpy from the lengths known up front (no torch op per span), for one upload."""
    parts = [np.arange(a, b, dtype=np.int64) for a, b in spans]
    return torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, dtype=np.int64))  # [S]


def span_starts(spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Each position of the spans, its span's start, as a host long tensor [S] (see `span_ranges`)."""
    starts = np.array([a for a, _ in spans], dtype=np.int64)
    return torch.from_numpy(np.repeat(starts, [b - a for a, b in spans]))  # [S]
