"""blendserve_vllm.layouts: prompt tokens to cache slots, and writes into the paged cache layouts of
vLLM 0.32's backends, each read back the way that backend reads it.

(`connector.head_range` is tested in test_connector.py: its module needs the fake vLLM there.)"""

from __future__ import annotations

import pytest
import torch

from blendserve_vllm.layouts import CacheShape, cpu_halves, slots, write_cpu, write_standard

B, H, N, D = 6, 2, 4, 3  # blocks, kv heads, tokens a block, head dim


# ------------------------------------------------------------------ slots
def test_slots_follow_the_block_table():
    # blocks 7, 2, 5 of 4 slots: tokens 0-3 -> 28-31, 4-7 -> 8-11, 8-9 -> 20-21
    assert slots([7, 2, 5], 4, 0, 10).tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert slots([7, 2, 5], 4, 5, 9).tolist() == [9, 10, 11, 20]
    assert slots((3,), 16, 15, 16).tolist() == [63]
    assert slots([7, 2, 5], 4, 5, 9).dtype == torch.int64


def test_slots_refuse_a_table_too_short():
    assert slots([7, 2], 4, 0, 8).tolist() == [28, 29, 30, 31, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="2 blocks of 4 cannot hold 9 tokens"):
        slots([7, 2], 4, 4, 9)


# ------------------------------------------------------------------ CUDA backends: [B, H, N, 2D]
def lbnhc(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's NHD: physical [B, N, H, 2D], registered as the logical [B, H, N, 2D] view."""
    phys = torch.randn(B, N, H, 2 * D).to(dtype)  # [B, N, H, 2D]
    return phys, phys.permute(0, 2, 1, 3)  # [B, H, N, 2D]


def lbhnc(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    phys = torch.randn(B, H, N, 2 * D).to(dtype)  # [B, H, N, 2D]
    return phys, phys


def blhnc(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-outermost: one allocation [B, L, H, N, 2D]; layer 1's cache is its view t[:, 1]."""
    phys = torch.randn(B, 3, H, N, 2 * D).to(dtype)  # [B, L, H, N, 2D]
    return phys, phys[:, 1]  # [B, H, N, 2D]


LAYOUTS = {"LBNHC": lbnhc, "LBHNC": lbhnc, "BLHNC": blhnc}


def read_back(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's read: (B, H, N, 2D) -> key, value (B, N, H, D)."""
    return cache.transpose(1, 2).split(D, dim=-1)


def expected_after(before: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """`before` with token t's K, V at slot[t], placed through the backend's own read view."""
    out = before.clone()  # [B, H, N, 2D]
    key, value = read_back(out)  # views of out: [B, N, H, D]
    for t, s in enumerate(slot.tolist()):
        key[s // N, s % N] = k[t]
        value[s // N, s % N] = v[t]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_write_standard_lands_where_the_backend_reads(layout, dtype):
    phys, cache = LAYOUTS[layout](dtype)
    assert cache.shape == (B, H, N, 2 * D)
    phys_before, before = phys.clone(), cache.clone()
    k = torch.randn(7, H, D)  # [T, H, D], float32: cast into the cache's dtype
    v = torch.randn(7, H, D)  # [T, H, D]
    slot = slots([4, 1, 3], N, 2, 9)  # tokens 2..8 -> blocks 4, 1, 3

    write_standard(cache, k, v, slot)

    key, value = read_back(cache)  # [B, N, H, D]
    for t, s in enumerate(slot.tolist()):
        assert torch.equal(key[s // N, s % N], k[t].to(dtype))
        assert torch.equal(value[s // N, s % N], v[t].to(dtype))
    assert torch.equal(cache, expected_after(before, k.to(dtype), v.to(dtype), slot))  # no other slot changed
    if layout == "BLHNC":  # the other layers of the shared allocation are untouched
        assert torch.equal(phys[:, 0], phys_before[:, 0]) and torch.equal(phys[:, 2], phys_before[:, 2])


def test_write_standard_fills_the_physical_nhd_rows():
    """The same write seen in FlashAttention's physical memory [B, N, H, 2D]: token t's K then V."""
    phys, cache = lbnhc()
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)  # [T, H, D]
    write_standard(cache, k, v, torch.tensor([5, 22, 9]))
    for t, s in enumerate([5, 22, 9]):
        assert torch.equal(phys[s // N, s % N], torch.cat([k[t], v[t]], dim=-1))  # [H, 2D]


def test_cache_shape_reads_a_layer_cache():
    assert CacheShape.of(torch.empty(B, H, N, 2 * D)) == CacheShape(B, H, N, 2 * D)
    with pytest.raises(ValueError, match="blocks, heads, block_size, content"):
        CacheShape.of(torch.empty(2, B, N, H, D))


# ------------------------------------------------------------------ CPU backend: vLLM's own op
class RecordingOp:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, *args) -> None:
        self.calls.append(args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_cpu_hands_vllms_op_the_backends_halves(dtype):
    cache = torch.randn(B, H, N, 2 * D).to(dtype)  # [B, H, N, 2D]
    before = cache.clone()
    k_all = torch.randn(5, H + 2, D)  # [T, H_total, D]
    k = k_all[:, 1:1 + H]  # [T, H, D], not contiguous
    v = torch.randn(H, 5, D).transpose(0, 1)  # [T, H, D], not contiguous
    assert not k.is_contiguous() and not v.is_contiguous()
    slot = slots([2, 0], N, 1, 6)
    op = RecordingOp()

    write_cpu(cache, k, v, slot, "vec", op)

    assert len(op.calls) == 1
    key, value, key_cache, value_cache, slot_arg, isa, k_scale, v_scale, kv_dtype = op.calls[0]
    for got, want in ((key, k), (value, v)):
        assert got.is_contiguous() and got.dtype == dtype and got.shape == (5, H, D)
        assert torch.equal(got, want.to(dtype))
    assert slot_arg is slot and isa == "vec"
    assert (k_scale, v_scale, kv_dtype) == (1.0, 1.0, "auto")

    # the halves vLLM's CPUAttentionBackendImpl.forward makes: views sharing the cache's storage
    item = cache.element_size()
    for half, offset in ((key_cache, 0), (value_cache, N * D * item)):
        assert half.shape == (B, H, N, D)
        assert half.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
        assert half.data_ptr() == cache.data_ptr() + offset
        assert half.stride() == (H * N * 2 * D, N * 2 * D, D, 1)
    ref_k, ref_v = cache.view(B, H, 2 * N, D).chunk(2, dim=2)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    assert torch.equal(cache, before)  # the fake op wrote nothing: write_cpu itself writes nothing

    value_cache[1, 0, 2].fill_(9)  # a write through the half reaches the cache's memory
    assert torch.equal(cache.view(B, H, 2 * N, D)[1, 0, N + 2], torch.full((D,), 9, dtype=dtype))


def test_cpu_halves_split_each_block_and_head_into_keys_then_values():
    cache = torch.arange(B * H * N * 2 * D, dtype=torch.float32).view(B, H, N, 2 * D)
    key_cache, value_cache = cpu_halves(cache)
    flat = cache.view(B, H, N * 2 * D)  # one block and head: N keys of D, then N values of D
    assert torch.equal(key_cache.reshape(B, H, -1), flat[:, :, :N * D])
    assert torch.equal(value_cache.reshape(B, H, -1), flat[:, :, N * D:])

