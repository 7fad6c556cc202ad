"""The layer packer: int8 chunks packed as int8 + scales and dequantized after the move equal the host decode."""

from __future__ import annotations

import torch

from blend_engine.kv_store import ChunkKV
from blend_engine.kv_store.codec import QuantLayer, decode_layer, encode_chunk
from blend_engine.transfer import LayerPacker
from tests.helpers import make_kv


def _int8_chunks(lengths: tuple[int, ...]) -> list[tuple]:
    """(meta, blobs) of int8 chunks of these lengths, K with an outlier channel (its scale dominates)."""
    out = []
    for i, t in enumerate(lengths):
        kv = make_kv(i, T=t, dtype=torch.float32)
        k = kv.k.clone()
        k[..., 3] *= 40.0  # [L, H, T, D]: one outlier channel, per chunk
        out.append(encode_chunk("int8", ChunkKV(k, kv.v)))
    return out


def test_int8_packed_and_dequantized_after_the_move_equals_the_host_decode():
    chunks = _int8_chunks((9, 1, 5))
    packer = LayerPacker("cpu", torch.float32, slots=2)
    for layer in range(4):
        quant = [decode_layer(meta, blobs[layer], quantized=True) for meta, blobs in chunks]
        assert all(isinstance(q, QuantLayer) for q in quant)
        host = [decode_layer(meta, blobs[layer]) for meta, blobs in chunks]  # (k, v) [H, T, D] fp32
        k, v = packer(quant).wait()  # [H, Tc, D] each
        assert k.dtype == torch.float32 and k.shape == (2, 15, 8)
        assert torch.equal(k, torch.cat([hk for hk, _ in host], dim=1))  # bit for bit
        assert torch.equal(v, torch.cat([hv for _, hv in host], dim=1))


def test_a_quantized_layer_is_half_the_bytes_of_fp16():
    (meta, blobs), = _int8_chunks((64,))
    q = decode_layer(meta, blobs[0], quantized=True)
    fp16 = 2 * q.kq.numel() * 2
    assert q.nbytes == meta.layer_nbytes and q.nbytes < 0.6 * fp16
