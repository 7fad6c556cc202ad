"""Writing a layer of handed-over KV into vLLM's paged cache, whatever backend made the cache.

vLLM (0.32) registers one tensor per attention layer with the logical shape [B, H, N, C]
(B blocks, H kv heads, N tokens a block, C content); its physical stride order varies by backend
(`KVCacheLayout`: LBHNC, LBNHC, ...), which strided writes through the logical view absorb.

- CUDA backends (FlashAttention, FlashInfer, Triton): C = 2D, a token's K in C[:D] and its V in
  C[D:] (what `kv_cache.transpose(1, 2).split(D, -1)` reads): `write_standard`.
- The CPU backend: per block and head the buffer [N, 2D] holds N keys and then N values, each
  packed as its kernel ISA reads it (`vec` stores keys transposed): only vLLM's own cache write
  (`torch.ops._C.cpu_attn_reshape_and_cache`, with the layer's `isa`) knows the packing, so
  `write_cpu` calls it, the same op vLLM writes fresh tokens with.

    token t of the prompt -> slot s = block_ids[t // N] * N + t % N -> block s // N, offset s % N
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

CpuWrite = Callable[..., None]  # vLLM's cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, ...)


@dataclass(frozen=True)
class CacheShape:
    """One layer's registered cache tensor [B, H, N, C], as the connector needs it."""

    blocks: int
    kv_heads: int
    block_size: int
    content: int

    @classmethod
    def of(cls, cache: torch.Tensor) -> CacheShape:
        if cache.dim() != 4:
            raise ValueError(f"expected a [blocks, heads, block_size, content] cache, got {tuple(cache.shape)}")
        return cls(*cache.shape)


def slots(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of prompt tokens start .. end-1 in a request's blocks: [end - start] int64."""
    t = torch.arange(start, end, dtype=torch.int64)  # [T]
    table = torch.as_tensor(block_ids, dtype=torch.int64)  # [blocks]
    if len(table) * block_size < end:
        raise ValueError(f"{len(table)} blocks of {block_size} cannot hold {end} tokens")
    return table[t // block_size] * block_size + t % block_size  # [T]


def write_standard(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> None:
    """CUDA backends: K [T, H, D] and V [T, H, D] into cache [B, H, N, 2D] at `slot` [T]."""
    D = k.shape[-1]
    n = cache.shape[2]
    block, offset = slot // n, slot % n  # [T], [T]
    cache[block, :, offset, :D] = k.to(cache.dtype)  # indexed view: [T, H, D]
    cache[block, :, offset, D:] = v.to(cache.dtype)  # [T, H, D]


def cpu_halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU backend's key and value caches, as its forward makes them: [B, H, N, 2D] viewed
    [B, H, 2N, D] and cut in two along the tokens (`CPUAttentionBackendImpl.forward`)."""
    B, H, N, _ = cache.shape
    return cache.view(B, H, 2 * N, -1).chunk(2, dim=2)  # 2 x [B, H, N, D]


def write_cpu(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, isa: str,
              op: CpuWrite) -> None:
    """vLLM's CPU backend: K [T, H, D] and V [T, H, D] written by vLLM's own cache write `op`."""
    key_cache, value_cache = cpu_halves(cache)
    op(k.to(cache.dtype).contiguous(), v.to(cache.dtype).contiguous(), key_cache, value_cache, slot, isa,
       1.0, 1.0, "auto")


def vllm_cpu_write() -> CpuWrite:
    """vLLM's CPU cache write (imported here so that the rest needs no vLLM)."""
    return torch.ops._C.cpu_attn_reshape_and_cache
