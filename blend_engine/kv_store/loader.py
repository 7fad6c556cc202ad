"""Layer-wise loading: the engine consumes one layer of every chunk at a time.

`LayerStream` is an iterator over layers; each item is the list of (k, v) [H, T, D] for the
requested chunks in order. Whether layer i+1 is read while layer i is computed is a scheduling
choice of the loader, invisible to the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from blend_engine.kv_store.base import ChunkKV, KVStore

Repair = Callable[[str], ChunkKV]
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LoadTrace:
    """Per-layer timings of one stream: read time, and how long the consumer waited for it."""

    read_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    bytes_read: int = 0
    repaired: list[str] = field(default_factory=list)


class LayerStream:
    """Synchronous stream: reads layer i when the engine asks for it (no overlap)."""

    def __init__(self, store: KVStore, keys: Sequence[str], n_layers: int, repair: Repair) -> None:
        self._store = store
        self._keys = list(keys)
        self._n_layers = n_layers
        self._repair = repair
        self._fixed: dict[str, ChunkKV] = {}
        self.trace = LoadTrace()

    def _read(self, layer: int) -> LayerKV:
        out: LayerKV = []
        for key in self._keys:
            got = self._fixed[key].layer(layer) if key in self._fixed else self._store.get_layer(key, layer)
            if got is None:  # missing or corrupt mid-stream: recompute from text, re-store, go on
                kv = self._repair(key)
                self._fixed[key] = kv
                self._store.put(key, kv)
                self.trace.repaired.append(key)
                got = kv.layer(layer)
            self.trace.bytes_read += got[0].numel() * got[0].element_size() * 2
            out.append(got)
        return out

    def __iter__(self) -> Iterator[LayerKV]:
        for layer in range(self._n_layers):
            t0 = time.perf_counter()
            item = self._read(layer)
            dt = time.perf_counter() - t0
            self.trace.read_s.append(dt)
            self.trace.wait_s.append(dt)
            yield item

    def close(self) -> None:
        pass


class LayerLoader:
    def __init__(self, store: KVStore) -> None:
        self.store = store

    def stream(self, keys: Sequence[str], n_layers: int, repair: Repair) -> LayerStream:
        return LayerStream(self.store, keys, n_layers, repair)
