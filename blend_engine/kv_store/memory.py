"""In-memory tier: a byte-budgeted LRU of chunks. The hot tier, and the test double.

Each chunk is one uint8 tensor of its layer blobs (layer-major), page-locked where CUDA exists so
a layer goes to the device in one DMA straight from it (`transfer`), plain memory on the CPU.
Blobs are views of it and float formats decode to views of those (no copy): callers must not
modify them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend_engine.kv_store.blob import Blob
from blend_engine.kv_store.codec import ChunkMeta
from blend_engine.kv_store.held import HeldTier
from blend_engine.kv_store.staging import pinnable

STORAGE_FORMATS = ("fp32", "fp16", "bf16", "int8")


@dataclass
class _Entry:
    meta: ChunkMeta
    data: torch.Tensor  # [L * layer_nbytes] uint8, pinned where CUDA exists
    blobs: list[memoryview]  # layer i's blob: a view of data


def _hold(meta: ChunkMeta, blobs: Sequence[Blob], pinned: bool) -> _Entry:
    """Copy a chunk's layer blobs into one tensor (page-locked when `pinned`)."""
    n = meta.layer_nbytes
    data = torch.empty(meta.nbytes, dtype=torch.uint8, pin_memory=pinned)  # [L * n]
    view = memoryview(data.numpy())
    for i, b in enumerate(blobs):
        view[i * n:(i + 1) * n] = b
    return _Entry(meta, data, [view[i * n:(i + 1) * n] for i in range(meta.n_layers)])


class MemoryStore(HeldTier):
    def __init__(self, budget_bytes: int = 2 << 30, kv_format: str = "fp16", name: str = "memory",
                 fingerprint: str = "", pinned: bool | None = None) -> None:
        if kv_format not in STORAGE_FORMATS:
            raise ValueError(f"memory store supports {list(STORAGE_FORMATS)}, not {kv_format!r}")
        super().__init__(name, kv_format, fingerprint, budget_bytes, kind="memory")
        self.pinned = pinnable() if pinned is None else pinned  # page-locked only where CUDA exists

    def _hold(self, meta: ChunkMeta, blobs: Sequence[Blob]) -> _Entry:
        return _hold(meta, blobs, self.pinned)

    def get_blob(self, key: str, layer: int) -> tuple[ChunkMeta, Blob] | None:
        e = self._served(key, layer)
        return None if e is None else (e.meta, e.blobs[layer])
