"""Decode attention read straight from the paged pool: one Triton kernel a layer (issue #35 item 5).

The pooled step's other way (`decode.Pooled` with `kernel="gather"`) copies every row's keys into
a padded [B, H, Lmax, D] tensor and calls SDPA: on an H200 that gather, element by element, took
most of a batch-64 step (benchmarks.decode_graph_check). Here each program (row b, KV head h) walks
its run's slots in the pool itself, with an online softmax (flash-decoding without the split):

    pool K[h]:  | ... | start[b] .. start[b] + n[b] - 1 : row b's keys | ... |
    row b:      G query heads of KV head h  x  keys lo(b) .. n[b]-1   (lo: the sliding window's first)

so K/V are read once, nothing is written but the [B, H, G, D] output, and nothing depends on the
host (a CUDA graph captures it). Needs Triton (CUDA; the interpreter, TRITON_INTERPRET=1, runs it
on the CPU for tests); `available()` says whether it can run here.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: no Triton
    triton = None

BLOCK_N = 128  # keys per inner step: with 4 warps the best measured on an H200 at B = 16 and 64 (2.5 TB/s)


def available(device: torch.device) -> bool:
    """Triton is importable and can run on `device` (CUDA, or the CPU under its interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, start: torch.Tensor,
                 n: torch.Tensor, pos: torch.Tensor, window: int | None, scale: float,
                 block: int = BLOCK_N, num_warps: int = 4) -> torch.Tensor:
    """q [B, H, G, D] (each KV head's G query rows) over the pool's k, v [H, slots, D]: row b sees
    slots start[b] .. start[b] + n[b] - 1 (key j at position j; on a sliding-window layer only
    j > pos[b] - window). Returns [B, H, G, D] in q's dtype."""
    b, h, g, d = q.shape
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("the pool's head dim must be contiguous")
    q = q.contiguous()  # [B, H, G, D]
    out = torch.empty_like(q)  # [B, H, G, D]
    _kernel[(b, h)](
        q, k_pool, v_pool, out, start, n, pos,
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        scale, 0 if window is None else window,
        G=g, D=d, G_PAD=max(16, triton.next_power_of_2(g)), D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK=block, WINDOWED=window is not None, IEEE=q.dtype == torch.float32, num_warps=num_warps,
    )
    return out


if triton is not None:

    @triton.jit
    def _kernel(q_ptr, k_ptr, v_ptr, out_ptr, start_ptr, n_ptr, pos_ptr,
                k_sh, k_ss, v_sh, v_ss, scale, window,
                G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                BLOCK: tl.constexpr, WINDOWED: tl.constexpr, IEEE: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        n_heads = tl.num_programs(1)
        k_head = k_ptr + head.to(tl.int64) * k_sh  # a large pool's offsets pass 2**31
        v_head = v_ptr + head.to(tl.int64) * v_sh
        start = tl.load(start_ptr + row)
        n = tl.load(n_ptr + row)
        lo = 0
        if WINDOWED:
            lo = tl.maximum(tl.load(pos_ptr + row) - window + 1, 0)
        gs = tl.arange(0, G_PAD)
        ds = tl.arange(0, D_PAD)
        q_off = ((row * n_heads + head) * G + gs[:, None]) * D + ds[None, :]  # [G_PAD, D_PAD]
        q_mask = (gs[:, None] < G) & (ds[None, :] < D)
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)  # [G_PAD, D_PAD]
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        j0 = (lo // BLOCK) * BLOCK + n * 0  # the first block (an int64 tensor either way)
        while j0 < n:  # (a `for` over a loaded bound fails in Triton's interpreter with numpy 2)
            js = j0 + tl.arange(0, BLOCK)  # [BLOCK] key positions
            valid = (js < n) & (js >= lo)
            kv_mask = valid[:, None] & (ds[None, :] < D)
            slot = start + js
            k = tl.load(k_head + slot[:, None] * k_ss + ds[None, :], mask=kv_mask, other=0.0)  # [BLOCK, D_PAD]
            v = tl.load(v_head + slot[:, None] * v_ss + ds[None, :], mask=kv_mask, other=0.0)  # [BLOCK, D_PAD]
            if IEEE:  # fp32: no TF32 rounding
                s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G_PAD, BLOCK]
            else:
                s = tl.dot(q, tl.trans(k))
            s = s.to(tl.float32) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # [G_PAD]
            p = tl.exp(s - m_new[:, None])  # [G_PAD, BLOCK]
            alpha = tl.exp(m_i - m_new)  # [G_PAD]
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")  # [G_PAD, D_PAD]
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv.to(tl.float32)
            m_i = m_new
            j0 += BLOCK
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)
