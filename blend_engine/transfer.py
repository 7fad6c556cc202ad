"""Moving cached layers from the host stores to the model's device, off the critical path.

`LayerPacker` runs on the loader's reader thread (see `kv_store.loader`): it packs one layer of
every cached chunk into one contiguous `[H, Tc, D]` block per K and V (a ring of host buffers,
pinned on CUDA), and on CUDA starts the block's host-to-device copy on a dedicated copy stream,
recording an event. The engine's thread only makes its compute stream wait for that event
(`PackedLayer.wait`, no host sync), so the copy of layer i+1 overlaps the compute of layer i.

On the CPU the same code packs into buffers of the compute dtype (the cast happens on the reader
thread too) and no copy is needed. Shapes: H kv heads, Tc cached tokens, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


def cuda_ready(device: torch.device) -> bool:
    """A real CUDA device (not a stand-in such as `meta`) that streams and events can drive."""
    return device.type == "cuda" and torch.cuda.is_available()


@dataclass
class PackedLayer:
    """One layer of the cached chunks: k, v [H, Tc, D] on the target device, `ready` its copy."""

    k: torch.Tensor
    v: torch.Tensor
    ready: object | None = None  # torch.cuda.Event on CUDA

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Order the consumer's stream after the copy (device-side wait, no host sync)."""
        if self.ready is not None:
            stream = torch.cuda.current_stream(self.k.device)
            stream.wait_event(self.ready)
            self.k.record_stream(stream)  # allocated on the copy stream, freed after use on this one
            self.v.record_stream(stream)
        return self.k, self.v


class LayerPacker:
    """Packs each layer's chunks into one contiguous block and starts its copy to `device`.

    `slots` host buffers are reused round-robin; the loader's read-ahead depth + 2 is enough
    (one being consumed, `depth` queued, one being written). Not thread-safe: one reader thread.
    """

    def __init__(self, device: torch.device | str, compute_dtype: torch.dtype, slots: int = 2) -> None:
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self._cuda = cuda_ready(self.device)
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._slots = max(2, slots)
        self._ring: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._events: list[object | None] = [None] * self._slots
        self._next = 0

    def __call__(self, layer_kv: LayerKV) -> PackedLayer:
        if self.device.type != "cpu" and all(kc.device == self.device for kc, _ in layer_kv):
            return PackedLayer(torch.cat([kc for kc, _ in layer_kv], dim=1),  # [H, Tc, D] already there
                               torch.cat([vc for _, vc in layer_kv], dim=1))
        if self._cuda and all(kc.is_pinned() and vc.is_pinned() for kc, vc in layer_kv):
            return self._copy_pinned(layer_kv)
        kb, vb = self._pack(layer_kv)  # [H, Tc, D] host buffers
        if self.device.type == "cpu":
            return PackedLayer(kb, vb)
        if not self._cuda:  # another device (or a stand-in): a plain transfer
            return PackedLayer(kb.to(self.device), vb.to(self.device))
        with torch.cuda.stream(self._stream):
            kd = kb.to(self.device, non_blocking=True)  # [H, Tc, D]
            vd = vb.to(self.device, non_blocking=True)  # [H, Tc, D]
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[(self._next - 1) % self._slots] = event
        return PackedLayer(kd, vd, event)

    def _pack(self, layer_kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        H, _, D = layer_kv[0][0].shape
        Tc = sum(kc.shape[1] for kc, _ in layer_kv)
        # the CPU computes in the compute dtype; a device gets the stored dtype (fewer bytes to move),
        # except values the codec decoded to fp32 (int8): those move in the compute dtype when narrower
        stored = layer_kv[0][0].dtype
        narrower = stored == torch.float32 and self.compute_dtype.itemsize < 4
        dtype = self.compute_dtype if self.device.type == "cpu" or narrower else stored
        slot = self._next % self._slots
        self._next += 1
        if not self._ring or self._ring[0][0].shape != (H, Tc, D) or self._ring[0][0].dtype != dtype:
            self._ring = [self._alloc((H, Tc, D), dtype) for _ in range(self._slots)]
            self._events = [None] * self._slots
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # this thread only: the previous copy out of the slot is done
        kb, vb = self._ring[slot]
        o = 0
        for kc, vc in layer_kv:
            t = kc.shape[1]
            kb[:, o:o + t].copy_(kc)  # [H, t, D], cast to the buffer's dtype
            vb[:, o:o + t].copy_(vc)
            o += t
        return kb, vb

    def _alloc(self, shape: tuple[int, int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(shape, dtype=dtype, pin_memory=self._cuda),
                torch.empty(shape, dtype=dtype, pin_memory=self._cuda))

    def _copy_pinned(self, layer_kv: LayerKV) -> PackedLayer:
        """Chunks already in pinned memory: copy each straight into its slice of a device block."""
        H, _, D = layer_kv[0][0].shape
        Tc = sum(kc.shape[1] for kc, _ in layer_kv)
        dtype = layer_kv[0][0].dtype
        with torch.cuda.stream(self._stream):
            kd = torch.empty((H, Tc, D), dtype=dtype, device=self.device)  # [H, Tc, D]
            vd = torch.empty((H, Tc, D), dtype=dtype, device=self.device)  # [H, Tc, D]
            o = 0
            for kc, vc in layer_kv:
                t = kc.shape[1]
                kd[:, o:o + t].copy_(kc, non_blocking=True)
                vd[:, o:o + t].copy_(vc, non_blocking=True)
                o += t
            event = torch.cuda.Event()
            event.record(self._stream)
        return PackedLayer(kd, vd, event)
