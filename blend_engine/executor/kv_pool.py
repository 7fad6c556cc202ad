"""The paged KV pool's tensors: per layer one K and one V of [H, n_blocks * block_tokens, D].

A sequence's run of consecutive blocks (`scheduler.kv_blocks.Run`) is a strided view of every
layer, `KVCache.k[l] = pool.k[l][:, start:start + capacity]`, so the layer loop, the placement,
the selection and the decode step read and write it as they do a dense cache, and attention reads
it with no gather. Copies happen only when a cached prefix is taken into a run elsewhere or a run
moves to a larger window.

    pool slots:  | run of seq a ............ | cached prefix | free | run of seq b ...... | free | scratch |

One block past the scheduler's blocks is scratch, never in a run: the padding rows of a decode step
replayed at a padded batch size write their K/V there (`decode_graphs`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.kv_blocks import Run

from .layers import KVCache


def block_bytes(runner: ModelRunner, block_tokens: int) -> int:
    """One block's K and V over every layer, in the model's dtype."""
    s = runner.shape
    return 2 * s.n_layers * s.n_kv_heads * s.head_dim * block_tokens * runner.dtype.itemsize


class KVPool:
    """Owns the pool's tensors (allocated on first use, in the engine loop's thread)."""

    def __init__(self, runner: ModelRunner, n_blocks: int, block_tokens: int) -> None:
        self.runner, self.n_blocks, self.block_tokens = runner, n_blocks, block_tokens
        self._kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(K, V): per layer [H, slots, D] each; one tuple for the pool's life (caches compare it by identity)."""
        if self._kv is None:
            s, r = self.runner.shape, self.runner
            shape = (s.n_kv_heads, (self.n_blocks + 1) * self.block_tokens, s.head_dim)  # + the scratch block
            k = [torch.empty(shape, dtype=r.dtype, device=r.device) for _ in range(s.n_layers)]  # L x [H, slots, D]
            v = [torch.empty(shape, dtype=r.dtype, device=r.device) for _ in range(s.n_layers)]  # L x [H, slots, D]
            self._kv = (k, v)
        return self._kv

    def prefault(self) -> int:
        """Allocate the pool now and write every page of it (zeros), so that its memory is resident
        before the first request and no step pays the kernel for a page's first write (a blend's
        placement into pool pages never written before faults in ~23 MB a 500-token prompt here). Only on
        the CPU: device memory is resident once allocated. Call it before the engine loop starts (it
        allocates the pool outside the loop's thread). Returns the bytes written."""
        k, v = self._tensors()
        if self.runner.device.type != "cpu":
            return 0
        for t in k + v:
            t.zero_()  # [H, slots, D]: every page written once
        return sum(t.numel() * t.element_size() for t in k + v)

    @property
    def kv(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The pool's (K, V): per layer [H, slots, D] each."""
        return self._tensors()

    @property
    def scratch_slot(self) -> int:
        """The first slot of the scratch block (no run's)."""
        return self.n_blocks * self.block_tokens

    def view(self, run: Run, length: int = 0) -> KVCache:
        """The run as a cache whose first `length` positions are valid."""
        cache = KVCache.over([], [], 0)
        self.rebind(cache, run)
        cache.length = length
        return cache

    def rebind(self, cache: KVCache, run: Run) -> None:
        """Point the cache's views at `run` (its KV must already be there)."""
        kv = self._tensors()
        k, v = kv
        a, n = run.start * self.block_tokens, run.n * self.block_tokens
        cache.k = [kl[:, a:a + n] for kl in k]  # L x [H, C, D] views
        cache.v = [vl[:, a:a + n] for vl in v]  # L x [H, C, D] views
        cache.capacity = n
        cache.pool, cache.offset = kv, a  # the decode step's pooled attention reads the pool itself

    def move(self, cache: KVCache, new: Run) -> None:
        """Copy the cache's valid positions into `new` (which may overlap its old run: compaction),
        then view it there."""
        n = cache.length
        k, v = self._tensors()
        a = new.start * self.block_tokens
        overlap = a < cache.offset + n and cache.offset < a + n  # compaction: copy through a clone
        for layer in range(len(k)):
            src_k, src_v = cache.k[layer][:, :n], cache.v[layer][:, :n]  # [H, n, D] each
            k[layer][:, a:a + n] = src_k.clone() if overlap else src_k  # [H, n, D]
            v[layer][:, a:a + n] = src_v.clone() if overlap else src_v  # [H, n, D]
        self.rebind(cache, new)

    def copy_prefix(self, src_blocks: Sequence[int], dst: Run) -> None:
        """Copy cached prefix blocks (in order) to the first blocks of `dst`: one slice copy per
        layer for each stretch of consecutive source blocks."""
        k, v = self._tensors()
        bt = self.block_tokens
        for i, start, count in _stretches(src_blocks):
            a, b = start * bt, (dst.start + i) * bt
            for layer in range(len(k)):
                k[layer][:, b:b + count * bt] = k[layer][:, a:a + count * bt]  # [H, count*bt, D]
                v[layer][:, b:b + count * bt] = v[layer][:, a:a + count * bt]  # [H, count*bt, D]


def _stretches(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index in `blocks`, first block, count) of each run of consecutive block ids."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks):
        if out and out[-1][1] + out[-1][2] == b:
            j, s, c = out[-1]
            out[-1] = (j, s, c + 1)
        else:
            out.append((i, b, 1))
    return out


DEFAULT_POOL_BYTES = 2 << 30  # on CUDA without a share of free memory
CPU_POOL_SHARE = 0.3  # of the memory available after the model, less the memory tier (vLLM's CPU build: 0.9)
MIN_AUTO_BLOCKS, MAX_AUTO_BLOCKS = 256, 8192  # the scheduler's window search is linear in blocks (~1 us each)


def pool_bytes(device: torch.device, budget_bytes: int | None, gpu_fraction: float | None, block_bytes: int,
               set_aside: int = 0) -> int:
    """The pool's size. On CUDA: that share of the device memory free now with `gpu_fraction` set,
    else `budget_bytes` (a setting; unset: 2 GiB). Elsewhere: `budget_bytes`, or unset
    `CPU_POOL_SHARE` of the memory available now less `set_aside` (the memory tier's budget), within
    256 and 8192 blocks of `block_bytes`. Call it after the weights are loaded, before any other tier."""
    if device.type == "cuda" and gpu_fraction is not None:
        if not 0 < gpu_fraction < 1:
            raise ValueError("the KV pool's share of free device memory must be within (0, 1)")
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * gpu_fraction)
    if budget_bytes is not None:
        return budget_bytes
    if device.type == "cuda":
        return DEFAULT_POOL_BYTES
    share = int(max(available_memory() - set_aside, 0) * CPU_POOL_SHARE)
    return min(max(share, MIN_AUTO_BLOCKS * block_bytes), MAX_AUTO_BLOCKS * block_bytes)


def available_memory() -> int:
    """Bytes this process could still take: the kernel's MemAvailable, bounded by the cgroup's limit
    (a container's `memory.max` less what it uses), as vLLM's CPU build sizes its KV space."""
    avail = _meminfo_available()
    limit = _cgroup_headroom()
    return avail if limit is None else min(avail, limit)


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_headroom(root: str = "/sys/fs/cgroup") -> int | None:
    """cgroup v2: memory.max - memory.current; None without a limit (or without cgroup v2)."""
    try:
        limit = open(os.path.join(root, "memory.max")).read().strip()
        if limit == "max":
            return None
        return max(int(limit) - int(open(os.path.join(root, "memory.current")).read()), 0)
    except (OSError, ValueError):
        return None
