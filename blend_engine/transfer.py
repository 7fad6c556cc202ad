"""Moving cached layers from the host stores to the model's device, off the critical path.

`LayerPacker` runs on the loader's reader thread (see `kv_store.loader`). It owns the staging
ring the loader reads into (`packer.staging`, pinned on CUDA): one buffer per layer, one region
per chunk, each chunk's layer blob (K and V, one slab) read straight into its region by the disk
tier. On CUDA the whole slot then crosses in ONE host-to-device copy, a chunk the memory tier
holds (pinned) in one copy straight from there, a chunk the device tier holds (`kv_store.device`)
not at all (decoded where it lies), and the chunks' K and V are concatenated into
`[H, Tc, D]` blocks once, on the device, all on the device's one copy stream (`copy_stream`),
which records an event. The engine's thread only makes its compute stream wait for that event
(`PackedLayer.wait`, no host sync), so the copy of layer i+1 overlaps the compute of layer i.

On the CPU no copy to a device is needed: a staged layer is gathered into ONE block `[2, H, Tc, D]`
(K then V of every chunk) by one strided host memcpy a chunk (numpy: no torch op, the GIL released),
then cast to the compute dtype and (int8) dequantized over the whole block, so the torch ops a
layer costs do not grow with the number of chunks (issue #57; `executor.dispatch_count` counts
them). Shapes: H kv heads, Tc cached tokens, D head dim, C chunks.

int8 chunks (`codec.QuantLayer`, asked for with `LayerPacker.moves_int8`) travel as int8: the ring
holds int8 kq, vq [H, Tc, D] plus their fp16 scales (K per chunk and channel [H, C, D], V per
token [H, Tc]), half the bytes of fp16 over PCIe; `PackedLayer.wait` dequantizes on the device in
fp32 with the codec's own formula, so the values equal the host decode's bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from blend_engine.kv_store.codec import FLOAT_FORMATS, ChunkMeta, QuantLayer, decode_raw, dequantize_k, dequantize_v
from blend_engine.kv_store.loader import LayerKV
from blend_engine.kv_store.staging import ALIGN, StagedLayer, StagingRing, pinnable
from blend_engine.scheduler.controller import PathCosts


def cuda_ready(device: torch.device) -> bool:
    """A real CUDA device (not a stand-in such as `meta`) that streams and events can drive."""
    return device.type == "cuda" and torch.cuda.is_available()


@functools.cache
def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The one host-to-device copy stream of a CUDA device, shared by every request on it."""
    return torch.cuda.Stream(device)


@dataclass(frozen=True)
class Int8Scales:
    """Scales of an int8 packed layer: ks [H, C, D] fp16 (per chunk and channel), vs [H, Tc] fp16
    (per token), chunk [Tc] int64 (each cached token's chunk)."""

    ks: torch.Tensor
    vs: torch.Tensor
    chunk: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.ks, self.vs, self.chunk

    def dequantize(self, kq: torch.Tensor, vq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kq, vq [H, Tc, D] int8 -> k, v [H, Tc, D] fp32, where the tensors are."""
        ks = self.ks.index_select(1, self.chunk)  # [H, Tc, D] fp16: each token's chunk scale
        return dequantize_k(kq, ks), dequantize_v(vq, self.vs)


@dataclass
class PackedLayer:
    """One layer of the cached chunks: k, v [H, Tc, D] on the target device (int8 when `scales`
    is set), `ready` the event of their copy."""

    k: torch.Tensor
    v: torch.Tensor
    ready: object | None = None  # torch.cuda.Event on CUDA
    scales: Int8Scales | None = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Order the consumer's stream after the copy (device-side wait, no host sync); k, v [H, Tc, D]
        (fp32 when dequantized here)."""
        if self.ready is not None:
            stream = torch.cuda.current_stream(self.k.device)
            stream.wait_event(self.ready)
            for t in (self.k, self.v, *(self.scales.tensors() if self.scales else ())):
                t.record_stream(stream)  # allocated on the copy stream, freed after use on this one
        if self.scales is None:
            return self.k, self.v
        return self.scales.dequantize(self.k, self.v)  # [H, Tc, D] fp32 each


class HostRing:
    """`slots` sets of host buffers reused round-robin (pinned on CUDA): the next slot's buffers of the
    asked (shape, dtype)s, free to overwrite once the copy out of it (its event) is done. One thread."""

    def __init__(self, slots: int, pinned: bool) -> None:
        self.slots, self.pinned = slots, pinned
        self._bufs: list[tuple[torch.Tensor, ...]] = []
        self._bytes: list[tuple[np.ndarray, ...] | None] = []  # per slot: its buffers' bytes, `host_slot`
        self.events: list[object | None] = [None] * slots  # per slot: the copy out of it
        self._next = 0

    @property
    def last(self) -> int:
        """The slot handed out last."""
        return (self._next - 1) % self.slots

    def slot(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[torch.Tensor, ...]:
        """The next slot's host buffers of these (shape, dtype)s, free to overwrite."""
        slot = self._next % self.slots
        self._next += 1
        if not self._bufs or [(tuple(t.shape), t.dtype) for t in self._bufs[0]] != specs:
            self._bufs = [tuple(torch.empty(shape, dtype=dt, pin_memory=self.pinned) for shape, dt in specs)
                          for _ in range(self.slots)]
            self.events = [None] * self.slots
            self._bytes = [None] * self.slots
        if self.events[slot] is not None:
            self.events[slot].synchronize()  # this thread only: the previous copy out of the slot is done
        return self._bufs[slot]

    def host_slot(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[tuple[torch.Tensor, ...],
                                                                               tuple[np.ndarray, ...]]:
        """`slot`'s buffers and numpy uint8 views of them ([..., last dim x itemsize] bytes), the views
        made once per slot (`numpy()` costs four torch ops)."""
        bufs = self.slot(specs)
        if self._bytes[self.last] is None:
            self._bytes[self.last] = tuple(t.view(torch.uint8).numpy() for t in bufs)
        return bufs, self._bytes[self.last]


class HostGather:
    """The CPU's packing of a staged layer: every chunk's blob copied into its columns of ONE block of
    the layer by one strided numpy memcpy, then a constant number of torch ops over the block (the cast
    to the compute dtype; int8: the dequantization), whatever the number of chunks."""

    def __init__(self, ring: HostRing, compute_dtype: torch.dtype,
                 chunks: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
        self.ring, self.compute_dtype, self.chunks = ring, compute_dtype, chunks

    def __call__(self, staged: StagedLayer) -> PackedLayer | None:
        """The layer as k, v [H, Tc, D]; None when one block cannot hold it: formats or shapes that
        differ, a blob that is a tensor on a device."""
        metas = staged.metas
        m0 = metas[0]
        if any((m.fmt, m.n_heads, m.head_dim) != (m0.fmt, m0.n_heads, m0.head_dim) for m in metas):
            return None
        raws = [host_bytes(b) for b in staged.blobs]  # [layer_nbytes] uint8 each, no copy
        if any(r is None for r in raws):
            return None
        lengths = tuple(m.n_tokens for m in metas)
        if m0.fmt == "int8":
            return self._int8(raws, lengths, m0.n_heads, m0.head_dim)
        return self._float(raws, lengths, m0.n_heads, m0.head_dim, FLOAT_FORMATS[m0.fmt])

    def _float(self, raws: list[np.ndarray], lengths: tuple[int, ...], H: int, D: int,
                    stored: torch.dtype) -> PackedLayer:
        """Float blobs (k [H, t, D] then v [H, t, D] each) -> k, v [H, Tc, D] of the compute dtype: the
        bytes gathered as stored, then one cast of the block where the dtypes differ."""
        Tc = sum(lengths)
        specs = [((2, H, Tc, D), stored)]
        if stored != self.compute_dtype:
            specs.append(((2, H, Tc, D), self.compute_dtype))
        bufs, (out, *_) = self.ring.host_slot(specs)
        gather_columns(out, [r.reshape(2, H, -1, D * stored.itemsize) for r in raws], lengths,
                       axis=2)  # [2, H, Tc, D * itemsize] bytes of the block
        block = bufs[0]  # [2, H, Tc, D] stored dtype
        kv = bufs[1].copy_(block) if len(bufs) > 1 else block  # [2, H, Tc, D] compute dtype
        return PackedLayer(kv[0], kv[1])

    def _int8(self, raws: list[np.ndarray], lengths: tuple[int, ...], H: int, D: int) -> PackedLayer:
        """int8 blobs (kq, vq [H, t, D], ks [H, D], vs [H, t]) -> k, v [H, Tc, D] fp32: gathered as
        stored, dequantized once over the block (`Int8Scales`, the codec's formula: bit for bit the
        host decode of each chunk)."""
        Tc, C = sum(lengths), len(lengths)
        (q, ks, vs), (qb, ksb, vsb) = self.ring.host_slot([((2, H, Tc, D), torch.int8), ((H, C, D), torch.float16),
                                                        ((H, Tc), torch.float16)])
        n = [2 * H * t * D for t in lengths]  # bytes of a chunk's kq and vq
        gather_columns(qb, [r[:m].reshape(2, H, -1, D) for r, m in zip(raws, n)], lengths,
                       axis=2)  # [2, H, Tc, D] int8
        gather_columns(ksb, [r[m:m + 2 * H * D].reshape(H, 1, 2 * D) for r, m in zip(raws, n)], (1,) * C,
                       axis=1)  # [H, C, 2D] bytes: fp16 [H, C, D]
        gather_columns(vsb, [r[m + 2 * H * D:].reshape(H, -1) for r, m in zip(raws, n)], tuple(2 * t for t in lengths),
                       axis=1)  # [H, 2Tc] bytes: fp16 [H, Tc]
        k, v = Int8Scales(ks, vs, self.chunks(lengths)).dequantize(q[0], q[1])  # [H, Tc, D] fp32 each
        return PackedLayer(k, v)


class LayerPacker:
    """Packs each layer's chunks into one contiguous block and starts its copy to `device`.

    `slots` host buffers (and staging slots) are reused round-robin; the loader's read-ahead
    depth + 2 is enough (one being consumed, `depth` queued, one being written). Not thread-safe:
    one reader thread.
    """

    def __init__(self, device: torch.device | str, compute_dtype: torch.dtype, slots: int = 2) -> None:
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.moves_int8 = self.device.type != "cpu"  # the CPU decodes on the host (measured: as fast)
        self._cuda = cuda_ready(self.device)
        self._stream = copy_stream(self.device) if self._cuda else None
        slots = max(2, slots)
        self.staging = StagingRing(slots, pinned=self._cuda, gather=self._cuda)  # what the loader reads into
        self._ring = HostRing(slots, pinned=self._cuda)
        self._chunk_index: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._gather = HostGather(self._ring, compute_dtype, self._chunks)  # the CPU's staged layers
        self._row_index: tuple[tuple, torch.Tensor] | None = None  # (layout, [2, H, Tc] gather rows), `_rows`
        self.uploaded_bytes = 0  # host-to-device bytes of staged layers (a device tier's chunks move none)
        self._moved: list = [0, 0.0]  # bytes, seconds of finished uploads not yet reported (upload_totals)
        self._timings: list[tuple[object, object, int]] = []  # CUDA: (start, end event, bytes) in flight

    def upload_totals(self) -> tuple[int, float]:
        """(bytes, seconds) of staged layers moved to the device since the last call: on CUDA the
        copy stream's time for the copies that have finished (events), on the CPU the packing copy
        into the compute dtype (the CPU's last leg). Read by the loader when its stream ends."""
        pending = []
        for start, end, nbytes in self._timings:  # each event asked once: one that finishes meanwhile is not lost
            if end.query():
                self._moved[0] += nbytes
                self._moved[1] += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end, nbytes))
        self._timings = pending
        out, self._moved = (self._moved[0], self._moved[1]), [0, 0.0]
        return out

    def __call__(self, layer_kv: LayerKV | StagedLayer) -> PackedLayer:
        if isinstance(layer_kv, StagedLayer):
            if self._cuda:
                return self._upload(layer_kv)
            t0 = time.perf_counter()
            nbytes = sum(len(b) for b in layer_kv.blobs if not isinstance(b, torch.Tensor))
            packed = self._gather(layer_kv) if self.device.type == "cpu" and not self.moves_int8 else None
            if packed is None:  # mixed formats or shapes, a blob on a device, another device
                packed = self._packed(layer_kv.decoded(quantized=self.moves_int8))  # views of the slot: copied
            self._moved[0] += nbytes
            self._moved[1] += time.perf_counter() - t0
            return packed
        return self._packed(layer_kv)

    def _packed(self, layer_kv: LayerKV) -> PackedLayer:
        """Per-chunk (k, v) [H, T, D] (or `QuantLayer`s) -> one block per K and V on the device."""
        quant = [isinstance(x, QuantLayer) for x in layer_kv]
        if all(quant):
            return self._int8(layer_kv)
        if any(quant):  # a store mixing formats: decode its int8 chunks here
            layer_kv = [x.dequantize() if isinstance(x, QuantLayer) else x for x in layer_kv]
        if self.device.type != "cpu" and all(kc.device == self.device for kc, _ in layer_kv):
            return PackedLayer(torch.cat([kc for kc, _ in layer_kv], dim=1),  # [H, Tc, D] already there
                               torch.cat([vc for _, vc in layer_kv], dim=1))
        if self._cuda and all(kc.is_pinned() and vc.is_pinned() for kc, vc in layer_kv):
            return self._copy_pinned(layer_kv)
        kb, vb = self._pack(layer_kv)  # [H, Tc, D] host buffers
        if self.device.type == "cpu":
            return PackedLayer(kb, vb)
        kd, vd, event = self._send(kb, vb)
        return PackedLayer(kd, vd, event)

    def _send(self, *host: torch.Tensor) -> tuple:
        """Start the copies of this slot's host buffers to the device: (*device tensors, event)."""
        if not self._cuda:  # another device (or a stand-in): a plain transfer
            return (*(t.to(self.device) for t in host), None)
        with torch.cuda.stream(self._stream):
            out = tuple(t.to(self.device, non_blocking=True) for t in host)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._ring.events[self._ring.last] = event
        return (*out, event)

    def _int8(self, layer: list[QuantLayer]) -> PackedLayer:
        """int8 chunks: packed as int8 + scales, moved as such, dequantized by `PackedLayer.wait`."""
        H, _, D = layer[0].shape
        lengths = tuple(q.shape[1] for q in layer)
        Tc, C = sum(lengths), len(layer)
        kq, vq, ks, vs = self._ring.slot([((H, Tc, D), torch.int8), ((H, Tc, D), torch.int8),
                                     ((H, C, D), torch.float16), ((H, Tc), torch.float16)])
        o = 0
        for j, q in enumerate(layer):
            t = lengths[j]
            kq[:, o:o + t].copy_(q.kq)  # [H, t, D] int8
            vq[:, o:o + t].copy_(q.vq)  # [H, t, D] int8
            ks[:, j].copy_(q.ks)  # [H, D] fp16
            vs[:, o:o + t].copy_(q.vs)  # [H, t] fp16
            o += t
        chunk = self._chunks(lengths)  # [Tc], before the copies: this layer's event covers its move
        if self.device.type == "cpu":
            return PackedLayer(*Int8Scales(ks, vs, chunk).dequantize(kq, vq))
        *moved, event = self._send(kq, vq, ks, vs)
        return PackedLayer(moved[0], moved[1], event, Int8Scales(moved[2], moved[3], chunk))

    def _chunks(self, lengths: tuple[int, ...]) -> torch.Tensor:
        """Each cached token's chunk, [Tc] int64 on the device: the same for every layer, moved
        once (on the copy stream, ahead of the first layer's event)."""
        if self._chunk_index is None or self._chunk_index[0] != lengths:
            index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths),
                                            output_size=sum(lengths))  # [Tc]: its size known, no read
            if self._cuda:
                with torch.cuda.stream(self._stream):
                    index = index.pin_memory().to(self.device, non_blocking=True)  # [Tc]
            else:
                index = index.to(self.device)  # [Tc]
            self._chunk_index = (lengths, index)
        return self._chunk_index[1]

    def _pack(self, layer_kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        H, _, D = layer_kv[0][0].shape
        Tc = sum(kc.shape[1] for kc, _ in layer_kv)
        # the CPU computes in the compute dtype; a device gets the stored dtype (fewer bytes to move),
        # except values decoded to fp32 on the host: those move in the compute dtype when narrower
        stored = layer_kv[0][0].dtype
        narrower = stored == torch.float32 and self.compute_dtype.itemsize < 4
        dtype = self.compute_dtype if self.device.type == "cpu" or narrower else stored
        kb, vb = self._ring.slot([((H, Tc, D), dtype), ((H, Tc, D), dtype)])
        o = 0
        for kc, vc in layer_kv:
            t = kc.shape[1]
            kb[:, o:o + t].copy_(kc)  # [H, t, D], cast to the buffer's dtype
            vb[:, o:o + t].copy_(vc)
            o += t
        return kb, vb

    def _copy_pinned(self, layer_kv: LayerKV) -> PackedLayer:
        """Chunks already in pinned memory: each K and V in one contiguous copy, concatenated once on the device."""
        with torch.cuda.stream(self._stream):
            kd = torch.cat([kc.to(self.device, non_blocking=True) for kc, _ in layer_kv], dim=1)  # [H, Tc, D]
            vd = torch.cat([vc.to(self.device, non_blocking=True) for _, vc in layer_kv], dim=1)  # [H, Tc, D]
            event = torch.cuda.Event()
            event.record(self._stream)
        return PackedLayer(kd, vd, event)

    def _upload(self, staged: StagedLayer) -> PackedLayer:
        """A staged layer to the device: one copy of the staging slot (the chunks read into it, and
        those copied into it here; split where a device-resident chunk's region lies between), one
        per chunk held in a tier's pinned memory, none for a chunk the device tier holds (copied
        device to device into its region), then K and V taken out of the block by ONE gather
        (`_rows`: an index made once per stream; int8, or a layout whose rows do not align: per
        chunk views concatenated), all on the copy stream."""
        slot = staged.slot
        at, direct, runs = staged.gather()  # pageable tier buffers copied into the slot
        hosted = [o + len(b) for o, b in zip(at, staged.blobs) if o is not None]
        rows = self._rows(staged, at)
        moved = self.uploaded_bytes
        with self._on_copy_stream():
            started = self._record(timing=True)
            size = slot.buf.numel() if rows is not None else max(hosted, default=0)
            block = torch.empty(size, dtype=torch.uint8, device=self.device)  # [bytes], like the slot
            for start, end in runs:  # one DMA for the slot (one per run between device-resident chunks)
                block[start:end].copy_(slot.buf[start:end], non_blocking=True)
                self.uploaded_bytes += end - start
            for o, src in direct:
                block[o:o + src.numel()].copy_(src, non_blocking=True)  # one DMA per pinned chunk
                self.uploaded_bytes += src.numel()
            if rows is not None:
                packed = self._gathered(block, rows, staged)
            else:
                parts = [decode_raw(m, self._resident(b) if o is None else block[o:o + m.layer_nbytes], quantized=True)
                         for m, o, b in zip(staged.metas, at, staged.blobs)]
                packed = self._concat(parts, staged.metas)
            packed.ready = slot.fence = self._record(timing=True)
        if started is not None:
            self._timings.append((started, packed.ready, self.uploaded_bytes - moved))
        return packed

    def _rows(self, staged: StagedLayer, at: list[int | None]) -> torch.Tensor | None:
        """The gather index [2, H, Tc] int64 on the device: for K then V, per head and cached token, the
        row (D values) of the layer's block that holds it. The same for every layer of a stream (its
        chunks' regions do not move), so it is built and moved once. None when one gather cannot do:
        int8, mixed formats or shapes, or a blob not starting on a row boundary."""
        metas = staged.metas
        m0 = metas[0]
        if m0.fmt not in FLOAT_FORMATS or any((m.fmt, m.n_heads, m.head_dim) != (m0.fmt, m0.n_heads, m0.head_dim)
                                              for m in metas):
            return None
        row = m0.head_dim * FLOAT_FORMATS[m0.fmt].itemsize  # bytes of one [D] row
        starts = tuple(staged.slot.offsets[i] if o is None else o for i, o in enumerate(at))
        if ALIGN % row or any(s % row for s in starts):
            return None
        key = (starts, tuple(m.n_tokens for m in metas), m0.n_heads, row)
        if self._row_index is not None and self._row_index[0] == key:
            return self._row_index[1]
        H = m0.n_heads
        heads = torch.arange(H)[:, None]  # [H, 1]
        k_rows, v_rows = [], []
        for s, m in zip(starts, metas):
            base = s // row + heads * m.n_tokens + torch.arange(m.n_tokens)[None, :]  # [H, T]: K's rows
            k_rows.append(base)
            v_rows.append(base + H * m.n_tokens)  # V follows K in the blob
        index = torch.stack([torch.cat(k_rows, dim=1), torch.cat(v_rows, dim=1)])  # [2, H, Tc]
        with self._on_copy_stream():
            index = (index.pin_memory() if pinnable() else index).to(self.device, non_blocking=True)  # [2, H, Tc]
        self._row_index = (key, index)
        return index

    def _gathered(self, block: torch.Tensor, rows: torch.Tensor, staged: StagedLayer) -> PackedLayer:
        """K and V [H, Tc, D] out of the layer's block [bytes] by one index_select over its rows; a
        device tier's chunks are first copied (device to device) into their regions of the block."""
        m0 = staged.metas[0]
        for i, (m, b) in enumerate(zip(staged.metas, staged.blobs)):
            if isinstance(b, torch.Tensor):
                o = staged.slot.offsets[i]
                block[o:o + m.layer_nbytes].copy_(self._resident(b), non_blocking=True)  # [bytes], on the device
        values = block.view(FLOAT_FORMATS[m0.fmt]).view(-1, m0.head_dim)  # [R, D]
        kv = values.index_select(0, rows.view(-1)).view(*rows.shape, m0.head_dim)  # [2, H, Tc, D]: the one gather
        return PackedLayer(kv[0], kv[1])

    def _resident(self, blob: torch.Tensor) -> torch.Tensor:
        """A device tier's blob [bytes] on this packer's device (it is, unless tiers and engine
        disagree). On CUDA it is marked as used by the copy stream, so the tier evicting the chunk
        meanwhile cannot hand its memory to another stream before the concatenation has read it."""
        if blob.device != self.device:
            return blob.to(self.device, non_blocking=True)
        if self._cuda:
            blob.record_stream(self._stream)
        return blob

    def _on_copy_stream(self):
        return torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext()

    def _record(self, timing: bool = False) -> object | None:
        """An event on the copy stream after what was queued on it (None off CUDA: copies are done);
        `timing`: one that `elapsed_time` can read."""
        if not self._cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(self._stream)
        return event

    def _concat(self, parts: list, metas: tuple[ChunkMeta, ...]) -> PackedLayer:
        """Per-chunk device views -> one [H, Tc, D] block per K and V (int8: kq, vq, and the scales)."""
        if not isinstance(parts[0], QuantLayer):
            return PackedLayer(torch.cat([k for k, _ in parts], dim=1),  # [H, Tc, D]
                               torch.cat([v for _, v in parts], dim=1))  # [H, Tc, D]
        chunk = self._chunks(tuple(m.n_tokens for m in metas))  # [Tc]
        scales = Int8Scales(torch.stack([q.ks for q in parts], dim=1),  # [H, C, D] fp16
                            torch.cat([q.vs for q in parts], dim=1),  # [H, Tc] fp16
                            chunk)
        return PackedLayer(torch.cat([q.kq for q in parts], dim=1),  # [H, Tc, D] int8
                           torch.cat([q.vq for q in parts], dim=1), scales=scales)


def host_bytes(blob: object) -> np.ndarray | None:
    """A blob's bytes as a uint8 array [nbytes] over the same memory (no copy); None for a tensor
    on a device."""
    if isinstance(blob, torch.Tensor):
        return blob.numpy() if blob.device.type == "cpu" else None
    return np.frombuffer(blob, dtype=np.uint8)


def gather_columns(out: np.ndarray, parts: list[np.ndarray], widths: tuple[int, ...], axis: int) -> None:
    """Part i (of width widths[i] along `axis`, `out`'s shape elsewhere) into its columns of `out`,
    one after the other: one strided memcpy a part, numpy's (no torch op; the GIL released)."""
    lead = (slice(None),) * axis
    o = 0
    for part, w in zip(parts, widths):
        np.copyto(out[(*lead, slice(o, o + w))], part)
        o += w


# ---------------------------------------------------------------------- start-up calibration
CALIBRATION_LAYERS = 4  # layers of the probe chunk
CALIBRATION_TOKENS = (32, 256)  # the two sizes of the layer-forward probe


def calibrate(runner, kv_format: str = "fp16", tokens: int = 256, reps: int = 3, workdir=None) -> PathCosts:
    """The controller's start-up estimates, measured once on the runner's device through the real
    path (`BandwidthController(calibrate=...)`): one probe chunk of the model's KV shape
    (`CALIBRATION_LAYERS` layers of `tokens` tokens) streamed from a disk tier (page cache warm: a
    fast drive; the disk tier's own counters replace it after the first real read) and from a
    memory tier into the engine's packer (its staging, upload and concatenation), and one layer
    forward at two sizes. Milliseconds of work; the best of `reps` runs of each. `workdir`: where
    the probe file goes (the disk tier's directory, so its file system is the one measured; default
    the temp dir)."""
    import tempfile
    from pathlib import Path

    from blend_engine.kv_store.base import ChunkKV
    from blend_engine.kv_store.disk import DiskStore
    from blend_engine.kv_store.memory import MemoryStore

    shape = runner.shape
    g = torch.Generator().manual_seed(0)
    dims = (CALIBRATION_LAYERS, shape.n_kv_heads, tokens, shape.head_dim)
    kv = ChunkKV(torch.randn(dims, generator=g).to(runner.dtype),  # [L, H, T, D]
                 torch.randn(dims, generator=g).to(runner.dtype))
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="blendserve-calibrate-", dir=workdir) as tmp:
        disk = DiskStore(Path(tmp), 1 << 40, kv_format=kv_format)
        disk.put("probe", kv)
        storage = _stream_costs(disk, runner, reps)
        disk.close()
    memory = MemoryStore(1 << 40, kv_format=kv_format)
    memory.put("probe", kv)
    held = _stream_costs(memory, runner, reps)
    fixed, per_token = _layer_costs(runner, reps)
    return PathCosts(storage_read_s=storage[0], stage_s=held[0], upload_s=min(storage[1], held[1]),
                     layer_fixed_s=fixed, token_layer_s=per_token)


def _stream_costs(store, runner, reps: int) -> tuple[float, float]:
    """(delivery into staging, upload) seconds per byte of one chunk streamed from `store` into a
    fresh packer, the best of `reps` streams."""
    from blend_engine.kv_store.loader import LayerLoader

    best = (float("inf"), float("inf"))
    for _ in range(reps + 1):  # the first warms the page cache, the readers and the allocator
        before = store.stats()
        packer = LayerPacker(runner.device, runner.dtype)
        stream = LayerLoader(store, 0).stream(["probe"], CALIBRATION_LAYERS, _no_repair, pack=packer)
        try:
            for packed in stream:
                packed.wait()
        finally:
            stream.close()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        after = store.stats()
        nbytes = after.bytes_read - before.bytes_read
        up = after.extra.get("upload_bytes", 0) - before.extra.get("upload_bytes", 0)
        up_s = after.extra.get("upload_seconds", 0.0) - before.extra.get("upload_seconds", 0.0)
        read = (after.read_seconds - before.read_seconds) / nbytes if nbytes else 0.0
        best = (min(best[0], read), min(best[1], up_s / up if up else 0.0))
    return best


def _no_repair(key: str):
    raise RuntimeError(f"calibration chunk {key} could not be read back")


def _layer_costs(runner, reps: int) -> tuple[float, float]:
    """(fixed seconds, seconds per token) of one layer forward (layer 0, causal, no cache), fitted
    through the best times at `CALIBRATION_TOKENS` tokens."""
    shape = runner.shape
    times = []
    with torch.inference_mode():
        for n in CALIBRATION_TOKENS:
            hidden = torch.randn(n, shape.hidden, generator=torch.Generator().manual_seed(n)).to(
                device=runner.device, dtype=runner.dtype)  # [n, E]
            cos, sin = runner.rope(torch.arange(n))  # [n, D] each
            best = float("inf")
            for _ in range(reps + 1):  # the first warms kernels and the allocator
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                t0 = time.perf_counter()
                q, k, v = runner.qkv(0, hidden, cos, sin)  # [Hq, n, D], [H, n, D], [H, n, D]
                runner.finish_layer(0, hidden, runner.attend(q, k, v, None, causal=True))  # [n, E]
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
    (n1, n2), (t1, t2) = CALIBRATION_TOKENS, times
    per_token = max((t2 - t1) / (n2 - n1), 1e-12)
    return max(t1 - per_token * n1, 0.0), per_token
