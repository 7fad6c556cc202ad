"""Weights kept in the block code they were de-quantized from, for the CPU's few-row projections.

A GGUF model is de-quantized once into float32 (`gguf_convert`), so every projection of a decode
step streams 4 bytes a weight from memory, where the file held ~0.6 (SmolLM2's Q4_1) or ~1.1
(its Q8_0 embedding, tied to the lm_head). On 2 CPU cores a decode step is bound by those reads.
Such a weight is still its code: every block of 32 inputs of a row is

    a4:  w = d * q + m,  q in 0..15       (Q4_1, and any 4-bit affine block code)
    s8:  w = d * q,      q in -128..127   (Q8_0)

with d and m float16 values, so d * q is exact in float32. `pack` finds that code from the float32
weight alone (d from the block's range, q by rounding) and keeps it only when expanding it gives
back every weight bit for bit; `cpu_kernels.packed_linear` expands it in registers and runs
`rows_linear`'s products in the same order: the same outputs from 1/5 (a4) or 1/3.5 (s8) of the
bytes. A weight of another origin (a float checkpoint, k-quants) does not verify and keeps the
float32 path. No per-request state; tensors only (built once per model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

BLOCK = 32  # inputs per code block
ROWS = range(1, 225)  # the most row counts that run on the codes (more: MKL on float32); `runner.packed_rows`
# measures where MKL takes over on the machine it runs on (~256 on the machine this bound came from, ~40 on an
# AVX-512 Xeon)


@dataclass(frozen=True)
class PackedWeight:
    """One nn.Linear weight [out, in] as block codes: a4 (`m` given) codes uint8 [out, in/2], byte j of
    a block = q[j] | q[j + 16] << 4; s8 codes int8 [out, in]; d, m float32 [out, in/32]."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m) if t is not None)

    def expand(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes stand for."""
        d = self.d[..., None]  # [out, in/32, 1]
        if self.m is None:
            q = self.codes.view(self.d.shape[0], -1, BLOCK).float()  # [out, in/32, 32]
            return (d * q).flatten(1)  # [out, in]
        c = self.codes.view(self.d.shape[0], -1, BLOCK // 2)  # [out, in/32, 16]
        q = torch.cat([c & 15, c >> 4], dim=-1).float()  # [out, in/32, 32]
        return (d * q + self.m[..., None]).flatten(1)  # [out, in]


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """The block code of a float32 CPU weight [out, in], or None where it has none (every weight is
    checked: the code expands to exactly `weight` or is not used)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 \
            or weight.shape[1] % BLOCK or not torch.isfinite(weight).all():
        return None
    w = weight.detach().contiguous()
    for code in (_a4, _s8):
        packed = code(w)
        if packed is not None and torch.equal(packed.expand(), w):
            return packed
    return None


def _scales(span: torch.Tensor, levels: int) -> torch.Tensor:
    """Each block's step d [out, in/32]: its span over the code's levels, as the float16 the file held."""
    return (span / levels).to(torch.float16).float()


def _a4(w: torch.Tensor) -> PackedWeight | None:
    blocks = w.view(w.shape[0], -1, BLOCK)  # [out, in/32, 32]
    m = blocks.amin(-1)  # [out, in/32]: q = 0's weight
    d = _scales(blocks.amax(-1) - m, 15)  # [out, in/32]
    q = ((blocks - m[..., None]) / _nonzero(d)[..., None]).round_()  # [out, in/32, 32]
    if q.min() < 0 or q.max() > 15:
        return None
    q = q.to(torch.uint8)
    codes = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)  # [out, in/32, 16]
    return PackedWeight(codes.reshape(w.shape[0], -1).contiguous(), d, m.contiguous())


def _s8(w: torch.Tensor) -> PackedWeight | None:
    blocks = w.view(w.shape[0], -1, BLOCK)  # [out, in/32, 32]
    d = _scales(blocks.abs().amax(-1), 127)  # [out, in/32]
    q = (blocks / _nonzero(d)[..., None]).round_()  # [out, in/32, 32]
    if q.min() < -128 or q.max() > 127:
        return None
    return PackedWeight(q.to(torch.int8).reshape(w.shape).contiguous(), d)


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """d with 1 where a block is constant (d = 0: every q is 0, the weight is m)."""
    return torch.where(d == 0, torch.ones_like(d), d)


def pack_linears(modules: list[torch.nn.Module]) -> dict[int, PackedWeight]:
    """{id(module): its code} for each float32 nn.Linear (no bias or any) whose weight has one."""
    out: dict[int, PackedWeight] = {}
    full = packed_bytes = 0
    for mod in modules:
        if type(mod) is not torch.nn.Linear or id(mod) in out:
            continue
        p = pack(mod.weight)
        if p is not None:
            out[id(mod)] = p
            full += mod.weight.numel() * 4
            packed_bytes += p.nbytes
    if out:
        logger.info("%d projections kept in their block code: %.0f MB read a step instead of %.0f",
                    len(out), packed_bytes / 1e6, full / 1e6)
    return out
