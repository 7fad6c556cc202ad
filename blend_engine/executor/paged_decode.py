"""Decode attention read straight from the paged pool: one Triton kernel a layer (issue #35 item 5).

The pooled step's other way (`decode.Pooled` with `kernel="gather"`) copies every row's keys into
a padded [B, H, Lmax, D] tensor and calls SDPA: on an H200 that gather, element by element, took
most of a batch-64 step (benchmarks.gpu.decode_graph_check). Here each program (row b, KV head h) walks
its run's slots in the pool itself, with an online softmax (flash-decoding):

    pool K[h]:  | ... | start[b] .. start[b] + n[b] - 1 : row b's keys | ... |
    row b:      G query heads of KV head h  x  keys lo(b) .. n[b]-1   (lo: the sliding window's first)
                split into S key ranges when B x H programs would leave the device idle (`splits`):
                each writes its partial max, sum and output, merged by a few torch ops

so K/V are read once, nothing is written but the [B, H, G, D] output, and nothing depends on the
host (a CUDA graph captures it). Needs Triton (CUDA; the interpreter, TRITON_INTERPRET=1, runs it
on the CPU for tests); `available()` says whether it can run here.
"""

from __future__ import annotations

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
    return device.type == "cuda" or bool(triton.knobs.runtime.interpret)  # Triton's own TRITON_INTERPRET


TARGET_PROGRAMS = 256  # about two programs per SM of an H200 (132 SMs)
SPLIT_BELOW = 64  # B x H programs under which key ranges split (measured without: B = 1 to 64 at 1K keys)
MAX_SPLITS = 32


def splits(rows: int, heads: int) -> int:
    """Key ranges per (row, KV head): one while B x H programs are at least SPLIT_BELOW (the
    measured kernel), else enough to make ~TARGET_PROGRAMS (B = 1 on 8 KV heads: 32), so a long
    single stream is not read by 8 programs. The split path is tested for equality, not yet timed
    on a GPU (`benchmarks.gpu.decode_graph_check --only kernel`)."""
    programs = rows * heads
    return 1 if programs >= SPLIT_BELOW else min(MAX_SPLITS, -(-TARGET_PROGRAMS // programs))


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, start: torch.Tensor,
                 n: torch.Tensor, pos: torch.Tensor, window: int | None, scale: float,
                 block: int = BLOCK_N, num_warps: int = 4, n_splits: int | None = None) -> torch.Tensor:
    """q [B, H, G, D] (each KV head's G query rows) over the pool's k, v [H, slots, D]: row b sees
    slots start[b] .. start[b] + n[b] - 1 (key j at position j; on a sliding-window layer only
    j > pos[b] - window). Returns [B, H, G, D] in q's dtype. `n_splits`: key ranges per row and
    head (None: `splits`); shapes depend on B alone, so a CUDA graph captures it."""
    b, h, g, d = q.shape
    if k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("the pool's head dim must be contiguous")
    s = n_splits or splits(b, h)
    q = q.contiguous()  # [B, H, G, D]
    out = torch.empty_like(q) if s == 1 else torch.empty(b, h, s, g, d, device=q.device)  # [B, H, (S,) G, D]
    part_m = torch.empty(b, h, s, g, device=q.device)  # [B, H, S, G] fp32: each range's max score
    part_l = torch.empty_like(part_m)  # [B, H, S, G]: its sum of exp(score - max)
    _kernel[(b, h, s)](
        q, k_pool, v_pool, out, part_m, part_l, start, n, pos,
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        scale, 0 if window is None else window,
        G=g, D=d, G_PAD=max(16, triton.next_power_of_2(g)), D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK=block, WINDOWED=window is not None, IEEE=q.dtype == torch.float32, SPLIT=s > 1, num_warps=num_warps,
    )
    if s == 1:
        return out
    return _merge(out, part_m, part_l).to(q.dtype)  # [B, H, G, D]


def _merge(acc: torch.Tensor, m: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The ranges' partial outputs acc [B, H, S, G, D] (unnormalised), maxima m and sums [B, H, S, G]
    as one softmax over all keys: [B, H, G, D] fp32. An empty range has m = -inf, sum 0."""
    top = m.amax(dim=2, keepdim=True)  # [B, H, 1, G]: finite (the first range always has keys)
    w = torch.exp(m - top)  # [B, H, S, G]
    return (acc * w[..., None]).sum(2) / (lse * w).sum(2)[..., None]  # [B, H, G, D]


if triton is not None:

    @triton.jit
    def _kernel(q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, start_ptr, n_ptr, pos_ptr,
                k_sh, k_ss, v_sh, v_ss, scale, window,
                G: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                BLOCK: tl.constexpr, WINDOWED: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        part = tl.program_id(2)
        n_heads = tl.num_programs(1)
        n_parts = tl.num_programs(2)
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
        first = (lo // BLOCK) * BLOCK + n * 0  # the first block (an int64 tensor either way)
        chunk = tl.cdiv(tl.cdiv(n - first, n_parts), BLOCK) * BLOCK  # keys per range, whole blocks
        j0 = first + part * chunk
        end = tl.minimum(j0 + chunk, n)  # (an empty range: j0 >= end, no step)
        m_i, l_i, acc = _attend_range(q, k_head, v_head, k_ss, v_ss, start, lo, j0, end, ds, scale,
                                      D, G_PAD, D_PAD, BLOCK, IEEE)  # [G_PAD], [G_PAD], [G_PAD, D_PAD]
        if SPLIT:  # this range's partials: [B, H, S, G(, D)]
            ml_off = ((row * n_heads + head) * n_parts + part) * G + gs  # [G_PAD]
            tl.store(m_ptr + ml_off, m_i, mask=gs < G)
            tl.store(l_ptr + ml_off, l_i, mask=gs < G)
            a_off = (((row * n_heads + head) * n_parts + part) * G + gs[:, None]) * D + ds[None, :]  # [G_PAD, D_PAD]
            tl.store(out_ptr + a_off, acc, mask=q_mask)
        else:
            tl.store(out_ptr + q_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _attend_range(q, k_head, v_head, k_ss, v_ss, start, lo, j0, end, ds, scale,
                      D: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
                      IEEE: tl.constexpr):
        """q [G_PAD, D_PAD] over the row's keys j0 .. end-1 (those from `lo`) at slots start + j, a block
        at a time: the online softmax's max and sum [G_PAD] and unnormalised output [G_PAD, D_PAD]."""
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        while j0 < end:  # (a `for` over a loaded bound fails in Triton's interpreter with numpy 2)
            js = j0 + tl.arange(0, BLOCK)  # [BLOCK] key positions
            valid = (js < end) & (js >= lo)
            kv_mask = valid[:, None] & (ds[None, :] < D)
            slot = start + js
            k = tl.load(k_head + slot[:, None] * k_ss + ds[None, :], mask=kv_mask, other=0.0)  # [BLOCK, D_PAD]
            v = tl.load(v_head + slot[:, None] * v_ss + ds[None, :], mask=kv_mask, other=0.0)  # [BLOCK, D_PAD]
            m_i, l_i, acc = _softmax_step(q, k, v, valid, m_i, l_i, acc, scale, IEEE)
            j0 += BLOCK
        return m_i, l_i, acc

    @triton.jit
    def _softmax_step(q, k, v, valid, m_i, l_i, acc, scale, IEEE: tl.constexpr):
        """One block of the online softmax: q [G_PAD, D_PAD] over keys k, values v [BLOCK, D_PAD] (those
        `valid`), folded into the max m_i, sum l_i [G_PAD] and output acc [G_PAD, D_PAD] so far."""
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
        return m_new, l_i, acc * alpha[:, None] + pv.to(tl.float32)
