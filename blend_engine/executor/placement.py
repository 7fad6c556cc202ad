"""Placement: cached chunks' K/V written into a request's cache at their place in the prompt.

Each chunk was computed alone at positions 0..T-1 and is moved to its offset by RoPE::

    cached:  | sys 0..s | chunk_1 0..t1 | chunk_2 0..t2 | ...
    placed:  | sys 0..s | chunk_1 s..s+t1 | chunk_2 s+t1.. | ... | question (recomputed) |
"""

from __future__ import annotations

import torch

from blend_engine.layout import Segment
from blend_engine.model import cpu_kernels
from blend_engine.model.runner import ModelRunner
from blend_engine.transfer import PackedLayer

from .uploads import span_ranges, span_starts, upload


class Placer:
    """Writes one layer of cached chunks into the request's cache at their new positions.

    The layer arrives packed (`transfer.PackedLayer`: one contiguous [H, Tc, D] block per K and V,
    already on the device or being copied there). Rotation tables for every cached token's move
    (its segment's offset) are built once per request on the device in fp32; each layer then
    needs one fused rotation in fp32, cast to the compute dtype, and two writes: on the CPU in
    float32 one pass of `cpu_kernels.place_rotated` (the same values bit for bit).
    """

    def __init__(self, runner: ModelRunner, cached: list[Segment]) -> None:
        self._dtype = runner.dtype
        spans = [(s.offset, s.end) for s in cached]
        self._contiguous = all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        self._start = spans[0][0] if spans else 0
        self._end = spans[-1][1] if spans else 0
        self._index = upload(span_ranges(spans), runner.device) if spans else None  # [Tc]
        self._kernel = runner.uses_cpu_kernels
        self._rot = None
        if spans:
            deltas = upload(span_starts(spans), runner.device)  # [Tc]: each cached token's move
            self._rot = runner.rotation(deltas, torch.float32)  # [Tc, D] each, fp32 on the device

    def place(self, K: torch.Tensor, V: torch.Tensor, packed: PackedLayer) -> None:
        """K, V [H, C, D]; packed: the cached chunks' k, v [H, Tc, D] at positions 0..T-1 each."""
        k, v = packed.wait()  # [H, Tc, D] each
        if self._takes(k, v):
            cpu_kernels.place_rotated(K, V, k, v, *(self._rot or (None, None)), self._index)
            return
        if self._rot is not None:
            k = ModelRunner.apply_rotation(k.float(), *self._rot).to(self._dtype)  # [H, Tc, D]
        if self._contiguous:
            K[:, self._start:self._end] = k
            V[:, self._start:self._end] = v
        else:
            K[:, self._index] = k.to(self._dtype)
            V[:, self._index] = v.to(self._dtype)

    def _takes(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether `cpu_kernels.place_rotated` places this layer: float32 blocks on the CPU, tables of k's shape."""
        return (self._kernel and self._index is not None and k.dtype == v.dtype == torch.float32
                and k.is_contiguous() and v.is_contiguous()
                and (self._rot is None or self._rot[0].shape == k.shape[1:]))
