"""A prefilled request's KV handed to another decoder (a vLLM server) as a shared-memory segment.

The executor owns the tensors, so the copy runs on the engine loop's thread right after the
prefill's last layer (`EngineLoop._prefilled`), while the request's run of the pool still holds it:

    cache k[l], v[l]: [H, C, D], positions 0 .. T-1 valid  ->  segment layer l: K [T, H, D], V [T, H, D]

`blendserve_vllm.segments` defines the segment; this module only fills one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend_engine.executor.layers import KVCache
from blendserve_vllm.segments import Published, SegmentMeta, SegmentPublisher, dtype_name, token_hash


@dataclass(frozen=True)
class Exported:
    """A published segment: its handle, how many prompt tokens it holds, bytes, and the copy's time."""

    handle: str
    n_tokens: int
    nbytes: int
    copy_ms: float


def segment_meta(cache: KVCache, token_ids: Sequence[int]) -> SegmentMeta:
    """The segment of the first len(token_ids) positions of `cache`, in the cache's dtype."""
    H, _, D = cache.k[0].shape
    return SegmentMeta(n_layers=len(cache.k), n_tokens=len(token_ids), kv_heads=H, head_dim=D,
                       dtype=dtype_name(cache.k[0].dtype), token_hash=token_hash(token_ids))


def export(cache: KVCache, token_ids: Sequence[int], publisher: SegmentPublisher) -> Exported:
    """Copy positions 0 .. T-1 of every layer of `cache` into a new segment (T = len(token_ids))."""
    T = len(token_ids)
    if cache.length < T:
        raise ValueError(f"the cache holds {cache.length} positions, the prompt has {T} tokens")
    t0 = time.perf_counter()

    def fill(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k.copy_(cache.k[layer][:, :T].transpose(0, 1))  # [H, T, D] -> [T, H, D]
        v.copy_(cache.v[layer][:, :T].transpose(0, 1))  # [H, T, D] -> [T, H, D]

    rec: Published = publisher.publish(segment_meta(cache, token_ids), fill)
    return Exported(rec.name, T, rec.nbytes, (time.perf_counter() - t0) * 1e3)
