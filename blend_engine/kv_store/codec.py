"""Stored precision of chunk KV: fp16 (default), fp32, bf16, and int8 (K per channel, V per token).

Every tier stores a chunk as one byte blob per layer (layer-major), so layer i can be read,
checked and decoded without touching the others. A blob is the concatenation of raw arrays:

- fp16 / fp32 / bf16: k [H, T, D] then v [H, T, D] in that dtype;
- int8 (KIVI-style): k_q [H, T, D] int8, v_q [H, T, D] int8, k_scale [H, D] fp16, v_scale [H, T]
  fp16, symmetric x ~= q * scale. K has outlier channels, so its scale is per channel (max|k| over
  the chunk's tokens, per head); V's is per token (max|v| over each token's head vector). A
  per-token K scale (the first int8 layout) let one outlier channel flatten every other channel
  of the token: first-token KL 0.18 against fp16.

No pickle anywhere: blobs are raw little-endian arrays; `ChunkMeta` is plain JSON.

Each layer blob carries a checksum (`ChunkMeta.checksums`), of the algorithm `ChunkMeta.checksum`
names: "xxh3_64" for every chunk written now (XXH3, 30+ GB/s here, an order of magnitude faster
than the disk or memory it guards), "crc32" (zlib, ~2-3 GB/s) for chunks written before, which
stay readable: a meta without the field is a crc32 meta. See docs/results-archive.md, "KV delivery into the staging buffers".
"""

from __future__ import annotations

import functools
import json
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import xxhash

from blend_engine.errors import CorruptChunk
from blend_engine.kv_store.base import ChunkKV

FLOAT_FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FORMATS = (*FLOAT_FORMATS, "int8")
_INT8_MAX = 127.0
CHECKSUM = "xxh3_64"  # what new chunks are written with
CHECKSUMS = ("xxh3_64", "crc32")


@dataclass(frozen=True)
class ChunkMeta:
    """What a stored chunk is: format, shape, per-layer checksums, owner fingerprint. No tensors."""

    fmt: str
    n_layers: int
    n_heads: int
    n_tokens: int
    head_dim: int
    checksums: tuple[int, ...]
    fingerprint: str = ""
    checksum: str = "crc32"  # the algorithm of `checksums`; metas written before it existed are crc32

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown KV format {self.fmt!r}; expected one of {FORMATS}")
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"unknown checksum {self.checksum!r}; expected one of {CHECKSUMS}")
        if len(self.checksums) != self.n_layers:
            raise ValueError(f"{len(self.checksums)} checksums for {self.n_layers} layers")

    @functools.cached_property
    def layer_nbytes(self) -> int:  # cached: read on every layer read
        return layer_nbytes(self.fmt, self.n_heads, self.n_tokens, self.head_dim)

    @property
    def nbytes(self) -> int:
        return self.layer_nbytes * self.n_layers

    def verify(self, layer: int, blob: bytes | bytearray | memoryview) -> bool:
        """Whether a layer blob has the stored length and checksum."""
        return len(blob) == self.layer_nbytes and checksum(blob, self.checksum) == self.checksums[layer]

    def to_json(self) -> str:
        d = asdict(self)
        d["checksums"] = list(self.checksums)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ChunkMeta:
        d = json.loads(text)
        d["checksums"] = tuple(int(c) for c in d["checksums"])
        return cls(**d)


def resolve_format(fmt: str, model_dtype: torch.dtype, device_type: str) -> str:
    """A configured KV format with "auto" made concrete: bf16 for a bf16 model on CUDA (fp16 could
    overflow its range), fp16 otherwise."""
    if fmt != "auto":
        return check_format(fmt)
    return "bf16" if model_dtype == torch.bfloat16 and device_type == "cuda" else "fp16"


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV format {fmt!r}; expected one of {FORMATS}")
    return fmt


def layer_nbytes(fmt: str, n_heads: int, n_tokens: int, head_dim: int) -> int:
    n = n_heads * n_tokens * head_dim
    if fmt == "int8":
        return 2 * n + 2 * n_heads * head_dim + 2 * n_heads * n_tokens
    return 2 * n * FLOAT_FORMATS[fmt].itemsize


def checksum(blob: bytes | bytearray | memoryview, algorithm: str = CHECKSUM) -> int:
    """A layer blob's checksum: XXH3-64 (what is written now) or zlib's CRC32 (older chunks)."""
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64_intdigest(blob)
    return zlib.crc32(blob)


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [H, T, D] -> (q int8 [H, T, D], scale fp16: max|x| / 127 over `dim`, which is dropped)."""
    xf = x.float()  # [H, T, D]
    scale = (xf.abs().amax(dim=dim) / _INT8_MAX).to(torch.float16)  # [H, D] (dim 1) or [H, T] (dim 2)
    safe = scale.float().clamp_min(1e-8).unsqueeze(dim)  # [H, 1, D] or [H, T, 1]
    q = torch.round(xf / safe).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)  # [H, T, D]
    return q, scale


def encode_layer(fmt: str, k: torch.Tensor, v: torch.Tensor) -> bytearray:
    """One layer's k, v [H, T, D] -> its stored blob."""
    k, v = k.detach().cpu(), v.detach().cpu()
    if fmt == "int8":
        kq, ks = _quantize(k, 1)  # [H, T, D], [H, D]: per channel
        vq, vs = _quantize(v, 2)  # [H, T, D], [H, T]: per token
        return bytearray().join((_raw(kq), _raw(vq), _raw(ks), _raw(vs)))
    dt = FLOAT_FORMATS[fmt]
    return bytearray().join((_raw(k.to(dt)), _raw(v.to(dt))))


@dataclass(frozen=True)
class QuantLayer:
    """One layer of an int8 chunk as stored (views of its blob, read-only): kq, vq [H, T, D] int8,
    ks [H, D] fp16 (K per channel), vs [H, T] fp16 (V per token). Moves as int8 to a device and is
    dequantized there (`transfer`); `dequantize` is the host decode, the one formula both use."""

    kq: torch.Tensor
    vq: torch.Tensor
    ks: torch.Tensor
    vs: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.kq.shape

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kq, self.vq, self.ks, self.vs))

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [H, T, D] fp32."""
        return dequantize_k(self.kq, self.ks.unsqueeze(1)), dequantize_v(self.vq, self.vs)


def dequantize_k(kq: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """kq [H, T, D] int8, ks [H, 1 or T, D] fp16 -> k [H, T, D] fp32 (exact products of exact fp32 casts)."""
    return kq.float() * ks.float()  # [H, T, D]


def dequantize_v(vq: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """vq [H, T, D] int8, vs [H, T] fp16 -> v [H, T, D] fp32."""
    return vq.float() * vs.float().unsqueeze(-1)  # [H, T, D]


def decode_layer(meta: ChunkMeta, blob: bytearray | memoryview,
                 quantized: bool = False) -> tuple[torch.Tensor, torch.Tensor] | QuantLayer:
    """A stored blob -> (k, v) [H, T, D], or with `quantized` an int8 layer as its `QuantLayer`.
    Float formats return views of `blob` (no copy): read-only by contract."""
    if len(blob) != meta.layer_nbytes:
        raise CorruptChunk(f"layer blob of {len(blob)} bytes, expected {meta.layer_nbytes}")
    return decode_raw(meta, torch.frombuffer(blob, dtype=torch.uint8), quantized)


def decode_raw(meta: ChunkMeta, raw: torch.Tensor, quantized: bool = False) -> tuple[torch.Tensor, torch.Tensor] | QuantLayer:
    """`decode_layer` of a blob already in a uint8 tensor `raw` [layer_nbytes], on any device: views."""
    H, T, D = meta.n_heads, meta.n_tokens, meta.head_dim
    n = H * T * D
    if meta.fmt == "int8":
        q = QuantLayer(raw[:n].view(torch.int8).view(H, T, D),  # kq [H, T, D]
                       raw[n:2 * n].view(torch.int8).view(H, T, D),  # vq [H, T, D]
                       raw[2 * n:2 * n + 2 * H * D].view(torch.float16).view(H, D),  # ks [H, D]
                       raw[2 * n + 2 * H * D:].view(torch.float16).view(H, T))  # vs [H, T]
        return q if quantized else q.dequantize()  # [H, T, D] each, fp32
    dt = FLOAT_FORMATS[meta.fmt]
    half = n * dt.itemsize
    k = raw[:half].view(dt).view(H, T, D)  # [H, T, D]
    v = raw[half:].view(dt).view(H, T, D)  # [H, T, D]
    return k, v


def encode_chunk(fmt: str, kv: ChunkKV, fingerprint: str = "") -> tuple[ChunkMeta, list[bytearray]]:
    """A chunk -> (meta, one blob per layer)."""
    check_format(fmt)
    blobs = [encode_layer(fmt, *kv.layer(i)) for i in range(kv.n_layers)]
    L, H, T, D = kv.k.shape
    meta = ChunkMeta(fmt, L, H, T, D, tuple(checksum(b) for b in blobs), fingerprint, CHECKSUM)
    return meta, blobs


def decode_chunk(meta: ChunkMeta, blobs: Sequence[bytearray]) -> ChunkKV:
    layers = [decode_layer(meta, b) for b in blobs]  # (k, v) [H, T, D] each
    k = torch.stack([kl for kl, _ in layers])  # [L, H, T, D]
    v = torch.stack([vl for _, vl in layers])  # [L, H, T, D]
    return ChunkKV(k, v)
