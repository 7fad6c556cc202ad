"""CacheBlend selection: which prompt positions are recomputed, and attending from them.

Token layout of every prompt (`layout.PromptLayout`)::

    | sys | chunk_1 .. chunk_k | question |
      exact   compete for        always
      (never  recompute by their  recomputed
      redone) K/V deviation

At the check layer every position's fresh K/V is compared with the blended cache; the chunks'
tokens that deviate most (optionally weighted by the question's attention to them) are kept,
with every forced position (uncached tokens, EPIC sinks), then narrowed at the schedule's
layers. `RankSpace` ranks, `Selection` attends from the kept positions. Neither reads a device
value on the host (no sync inside the layer loop).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from blend_engine.executor.attention import flex_attend, selected_block_mask
from blend_engine.executor.uploads import upload
from blend_engine.explain import ScoreProbe
from blend_engine.layout import PromptLayout, Segment
from blend_engine.model import cpu_kernels
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.budget import kept
from blend_engine.scheduler.plans import competing, end_count, sink_count
from blend_engine.types import SelectionPolicy

# ModelRunner.window_masks: (query positions [S], key count) -> (layer -> window mask [S, N] or None)
WindowMasks = Callable[[torch.Tensor, int], Callable[[int], "torch.Tensor | None"]]


BLOCK_ROWS = 32  # the fewest selected rows a block of the CPU's blocked attention gets
MAX_BLOCKS = 16


def query_blocks(rows: int) -> int:
    """How many position-ordered blocks the CPU's selected attention splits `rows` queries into. A
    block reads the keys up to its last position, so k blocks of queries spread over the prompt
    compute about (1/2 + 1/(2k)) of the full rectangle, against the causal 1/2; each block is one
    more SDPA call. Measured at 4K tokens (SmolLM2-135M's heads, 2 threads): 16 blocks took 29 ms
    for 640 rows and 97 ms for 2,440, against 35 ms and 123 ms for 4; 32 blocks were no faster."""
    return max(1, min(MAX_BLOCKS, rows // BLOCK_ROWS))


def block_rows(rows: int, blocks: int | None = None) -> list[tuple[int, int]]:
    """The (first, end) rows of each position-ordered block of `rows` selected rows: `blocks` of them
    (`query_blocks` when None), never an empty one, the first rows % k one row longer (as
    `torch.tensor_split`); host ints, no tensor."""
    k = min(blocks or query_blocks(rows), rows)
    size, extra = divmod(rows, k)
    ends = [(i + 1) * size + min(i + 1, extra) for i in range(k)]
    return list(zip([0, *ends[:-1]], ends))


def cpu_kernel(attention: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether rows at given positions attend through `cpu_kernels.selected_attention`: "auto" on the
    CPU where the kernel takes the cache (float32, a head dim of 16 x 1..8, built). At 4.6K tokens
    (SmolLM2-135M's heads, 2 threads) it ran a blend's selected rows at ~70M (row, key) cells a second
    against 38-51M for 16 position-ordered SDPA blocks, and a full causal prefill's at ~70M against SDPA's
    58-62M (`python -m benchmarks.kernels.prefill_attention`)."""
    return attention == "auto" and device.type == "cpu" and cpu_kernels.selected_usable(dtype, head_dim)


class Selection:
    """The positions recomputed at a layer and what attending from them needs, built once per set
    (the set changes only at the check layer and the schedule's layers, not at every layer).

    `kernel` (the caller's `cpu_kernel`): one call of the CPU's C++ kernel over the positions, each
    row's keys up to its own. Else `attention` (`EngineConfig.selected_attention`): "auto" is
    "blocks" on the CPU, "sdpa_mask" elsewhere. "blocks": queries split into position-ordered
    blocks; each reads only the keys up to its last position, under an additive causal mask by
    absolute position: ~S x N / 2 work, not S x N. The keys a block reads are a data-dependent
    shape: the blocks' last positions are read on the host, in one read per set (free on the CPU,
    the only place it runs; on a device it would be a sync, and a device never takes this path),
    and a set of more rows splits into more blocks (`query_blocks`), each one more SDPA call a
    layer: the one mode whose ops a layer follow the selection's size, and that reads the host
    inside the layer loop (issue #57). "sdpa_mask": one boolean mask [S, N] by
    absolute position, built on the device (no data-dependent shape), SDPA keeps its
    memory-efficient kernel. "flex": FlexAttention with a block mask from the positions
    (`attention`), one per window size.
    """

    def __init__(self, pos: torch.Tensor, cos_all: torch.Tensor, sin_all: torch.Tensor, n: int,
                 window_masks: WindowMasks, blocks: int | None = None, attention: str = "auto",
                 kernel: bool = False) -> None:
        self.pos = pos  # [S] sorted absolute positions
        self.cos, self.sin = cos_all[pos], sin_all[pos]  # [S, D] each
        self._n = n
        self._windows = window_masks(pos, n)  # layer -> [S, N] or None, built once per set and window size
        self._blocks: list[tuple[int, int, int, torch.Tensor, Callable[[int], torch.Tensor | None]]] = []
        self._mask: torch.Tensor | None = None
        self._flex: dict[int | None, BlockMask] | None = {} if attention == "flex" else None
        self._kernel = kernel
        if self._flex is not None or kernel:
            return
        if attention == "sdpa_mask" or pos.device.type != "cpu":
            self._mask = torch.arange(n, device=pos.device)[None, :] <= pos[:, None]  # [S, N] bool
            return
        rows = block_rows(pos.numel(), blocks)  # [(first, end)] of each block, host ints
        last = torch.tensor([b - 1 for _, b in rows])  # [k] each block's last row
        his = [x + 1 for x in pos[last].tolist()]  # the set's ONE host read (free on the CPU): the keys each reads
        for (a, b), hi in zip(rows, his):
            p = pos[a:b]  # [s]
            allowed = torch.arange(hi)[None, :] <= p[:, None]  # [s, hi]
            mask = torch.zeros(allowed.shape, dtype=cos_all.dtype)  # [s, hi]
            self._blocks.append((a, b, hi, mask.masked_fill_(~allowed, float("-inf")), window_masks(p, hi)))

    def attend(self, r: ModelRunner, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, layer: int) -> torch.Tensor:
        """q [Hq, S, D] of the selected positions over the blended cache K, V [H, C, D]: [S, Hq*D].
        A sliding-window layer uses the model's window mask instead of the causal one."""
        if self._flex is not None:
            window = r.windows[layer]
            if window not in self._flex:  # built once per set and window size, on the device
                self._flex[window] = selected_block_mask(self.pos, self._n, window)
            return flex_attend(q, K[:, :self._n], V[:, :self._n], self._flex[window], r.scaling,
                               fallback=lambda: self._attend_masked(r, q, K, V, layer))  # [S, Hq*D]
        if self._kernel:
            return cpu_kernels.selected_attention(q, K[:, :self._n], V[:, :self._n], self.pos, r.windows[layer],
                                                  r.scaling)  # [S, Hq*D]
        if self._mask is not None:
            return self._attend_masked(r, q, K, V, layer)  # [S, Hq*D]
        outs = [r.attend(q[:, a:b], K[:, :hi], V[:, :hi], causal if (window := windows(layer)) is None else window)
                for a, b, hi, causal, windows in self._blocks]  # [s, Hq*D] each
        return torch.cat(outs)  # [S, Hq*D]

    def _attend_masked(self, r: ModelRunner, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, layer: int) -> torch.Tensor:
        """One boolean mask [S, N] by absolute position (the window mask on a sliding layer): [S, Hq*D]."""
        if self._mask is None:  # "flex" whose compile failed: built once, on the device
            self._mask = torch.arange(self._n, device=self.pos.device)[None, :] <= self.pos[:, None]  # [S, N] bool
        window = self._windows(layer)  # [S, N] or None
        return r.attend(q, K[:, :self._n], V[:, :self._n], self._mask if window is None else window)  # [S, Hq*D]


_OTHER, _COMPETE, _FORCED = 0, 1, 2


class RankSpace:
    """Which positions compete for recompute, and how they are ranked.

    Competing: tokens of cached passages. Always kept: uncached tokens (the question, passages that
    missed the cache) and, with EPIC boundaries, the first k (sinks) and last k (ends) tokens of
    each passage. The system prefix is never recomputed: cached alone at position 0 it is exact.

        | sys (exact) | passage_1 .. passage_k (compete) | question (always) |

    Selection has fixed sizes known on the host: every row of the current set is scored, forced
    rows get +inf, rows that never compete -inf, and one `topk` of a size computed from counts
    keeps the forced rows plus the best competitors. No host sync, no data-dependent shape.
    """

    def __init__(self, layout: PromptLayout, cached: list[Segment], scale: float, sink_tokens: int = 0,
                 device: torch.device | str = "cpu", probe: ScoreProbe | None = None, end_tokens: int = 0) -> None:
        self.scale = scale
        self.probe = probe  # explain: keeps the check layer's scores (device tensors, no sync)
        cached_offsets = {s.offset for s in cached}
        self.n = layout.n_tokens
        kind = [_OTHER] * self.n  # per position, on the host
        compete: list[int] = []
        always: list[int] = []
        self.passages: list[tuple[int, int]] = []  # the competing chunks' spans
        for seg in layout.segments:
            if seg.offset not in cached_offsets:
                always += range(seg.offset, seg.end)
                kind[seg.offset:seg.end] = [_FORCED] * (seg.end - seg.offset)
            elif competing(seg, True):
                compete += range(seg.offset, seg.end)
                self.passages.append((seg.offset, seg.end))
                sinks, ends = sink_count(seg, sink_tokens), end_count(seg, sink_tokens, end_tokens)
                middle = seg.end - seg.offset - sinks - ends
                kind[seg.offset:seg.end] = [_FORCED] * sinks + [_COMPETE] * middle + [_FORCED] * ends
        # built on the host once per request, each moved by one pinned non-blocking upload (`uploads`)
        device = torch.device(device)
        self.compete = upload(torch.tensor(compete, dtype=torch.long), device)  # [P] cached chunk tokens, sinks too
        self.always = upload(torch.tensor(always, dtype=torch.long), device)  # [U] uncached tokens
        self.n_forced, self.n_compete = kind.count(_FORCED), kind.count(_COMPETE)
        table = {_OTHER: float("-inf"), _COMPETE: 0.0, _FORCED: float("inf")}
        self.base = upload(torch.tensor([table[c] for c in kind], dtype=torch.float32), device)  # [N] score offsets
        last = layout.segments[-1]
        self.n_query = last.end - last.offset  # the question: always recomputed, the last Q positions
        self.query = torch.arange(last.offset, last.end, device=device)  # [Q]
        P = len(self.passages)
        pid = np.full(self.n, P, dtype=np.int64)  # [N]; P: in no cached passage (numpy: no torch op a passage)
        for i, (s, e) in enumerate(self.passages):
            pid[s:e] = i
        self.pid = upload(torch.from_numpy(pid), device)  # [N]
        self.passage_len = upload(torch.tensor([float(e - s) for s, e in self.passages]), device)  # [P]
        self._mass_sum: torch.Tensor | None = None  # query_mass "running": summed over selecting layers
        self._mass_count = 0

    def select(self, q, k, v, K, V, ratio: float, policy: SelectionPolicy, current: torch.Tensor | None,
               multiplier: float = 1.0) -> torch.Tensor:
        """Positions to keep recomputing, sorted [S']. See `select_rows`."""
        return self.select_rows(q, k, v, K, V, ratio, policy, current, multiplier)[0]

    def select_rows(self, q, k, v, K, V, ratio: float, policy: SelectionPolicy, current: torch.Tensor | None,
                    multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions to keep recomputing [S'], their rows in `current`), both sorted: every forced
        position plus `budget.kept(competitors, ratio, multiplier)` competitors.

        q [Hq, S, D], k, v [H, S, D]: fresh values for `current` (None = all N positions);
        K, V [H, C, D]: the blended cache of this layer before the fresh values are written.
        `current` always holds every forced position (they are kept at every narrowing).
        """
        n_forced, n_compete = self.n_forced, self.n_compete
        S = self.n if current is None else current.shape[0]
        present = n_compete if current is None else S - n_forced  # competitors in the current set
        take = n_forced + (min(kept(n_compete, ratio, multiplier), present) if policy.use_deviation else 0)
        rows_base = self.base if current is None else self.base[current]  # [S]
        if policy.use_deviation and take > n_forced:
            old_k = K[:, :S] if current is None else K[:, current]  # [H, S, D]
            old_v = V[:, :S] if current is None else V[:, current]  # [H, S, D]
            competing = rows_base == 0  # [S]; only these rows have cached K/V to compare with
            score = deviation(k, v, old_k, old_v, policy.metric, weight=competing)  # [S]
            mass = None
            if policy.query_weighted or policy.allocation == "attention":
                mass = self._question_mass(q, k, K, current, policy.query_mass)  # [N]
            if policy.query_weighted:
                score = score * (mass if current is None else mass[current])  # [S]
            if self.probe is not None and current is None:  # rows are positions at the check layer
                self.probe.record(self.compete, score[self.compete])  # [P] each, device tensors
            if policy.allocation != "global":
                rows_pid = self.pid if current is None else self.pid[current]  # [S]
                score = shared_out(score, competing, rows_pid, self._quota(policy.allocation, mass))  # [S]
            # uncached rows' K/V were never filled (leftover memory: NaN, inf, anything): their
            # score is the base alone, so garbage can neither outrank nor poison the competitors
            score = torch.where(competing, score, rows_base)  # [S]
        else:
            score = rows_base  # [S]
        rows = torch.topk(score, take).indices.sort().values  # [S'] rows, sorted = positions sorted
        return (rows if current is None else current[rows]), rows

    def fixed(self, positions: torch.Tensor) -> torch.Tensor:
        """The forced positions plus `positions` [R], sorted [S]: a selection given by a research run
        (`layers.LayerHooks`; it reads device values on the host). Every given position must compete."""
        if positions.numel() and not bool((self.base[positions] == 0).all()):
            raise ValueError("a given selection may only hold competing (cached passage) positions")
        forced = torch.nonzero(self.base == float("inf")).flatten()  # [F]
        return torch.unique(torch.cat([forced, positions.to(forced.device)]))  # [S] sorted

    def _quota(self, allocation: str, mass: torch.Tensor | None) -> torch.Tensor:
        """Each passage's share of the budget, unnormalised: its tokens, or the question's attention to it [P]."""
        if allocation == "length":
            return self.passage_len  # [P]
        P = len(self.passages)
        return torch.zeros(P + 1, device=mass.device).index_add_(0, self.pid, mass.float())[:P]  # [P]

    def _question_mass(self, q, k, K, current: torch.Tensor | None, how: str) -> torch.Tensor:
        """The question's attention per position at this layer ("layer"), or its mean over every
        selecting layer so far ("running"): [N]."""
        mass = self._attention_mass(q, k, K, current)  # [N]
        if how == "layer":
            return mass
        self._mass_sum = mass if self._mass_sum is None else self._mass_sum + mass  # [N]
        self._mass_count += 1
        return self._mass_sum / self._mass_count  # [N]

    def _attention_mass(self, q, k, K, current: torch.Tensor | None) -> torch.Tensor:
        """Attention the question's queries pay each position, summed over heads and queries: [N].

        Keys are this layer's as the question will see them: fresh for `current`, cached elsewhere.
        The question is the last Q positions, so its rows are the last Q of q in either case.
        """
        n, Q = self.n, self.n_query
        if current is None:
            keys = k[:, :n]  # [H, N, D]
        else:
            keys = K[:, :n].clone()  # [H, N, D]
            keys[:, current] = k
        H, D = keys.shape[0], keys.shape[2]
        group = q.shape[0] // H
        qq = q[:, -Q:].reshape(H, group * Q, D)  # [H, G*Q, D] (q heads grouped per kv head)
        logits = (qq.float() @ keys.float().transpose(1, 2)) * self.scale  # [H, G*Q, N]
        qpos = torch.arange(n - Q, n, device=keys.device).repeat(group)  # [G*Q]
        mask = torch.arange(n, device=keys.device)[None, :] <= qpos[:, None]  # [G*Q, N]
        logits = logits.masked_fill(~mask, float("-inf"))  # [H, G*Q, N]
        return torch.softmax(logits, dim=-1).sum(dim=(0, 1))  # [N]


def shared_out(score: torch.Tensor, competing: torch.Tensor, pid: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """Scores [S] that make one global top-k honour per-passage shares.

    A competing row of passage p whose score ranks r-th (0-based) within p gets -(r + 0.5) / quota[p]:
    a top-k over these keeps about k x quota[p] / sum(quota) rows of each passage, best first within
    it, and hands the share a passage cannot fill (fewer candidates) to the next best elsewhere.
    pid [S]: each row's passage (len(quota) for rows in none); competing [S] bool; quota [P] > 0.
    Other rows get -inf (the caller puts their own base back). Device ops only, no host sync.
    """
    S, P = score.shape[0], quota.shape[0]
    pid = torch.where(competing, pid, P)  # [S]
    order = torch.argsort(score.masked_fill(~competing, float("-inf")), descending=True, stable=True)  # [S]
    order = order[torch.argsort(pid[order], stable=True)]  # [S] grouped by passage, best first within each
    counts = torch.bincount(pid, minlength=P + 1)  # [P+1]
    starts = torch.cumsum(counts, 0) - counts  # [P+1] first slot of each passage in `order`
    rank = torch.empty_like(order)  # [S]
    rank[order] = torch.arange(S, device=score.device) - starts[pid[order]]
    share = torch.cat([quota.float().clamp_min(1e-12), quota.new_ones(1, dtype=torch.float32)])[pid]  # [S]
    return torch.where(competing, -(rank.float() + 0.5) / share, float("-inf"))  # [S]


def deviation(k_new, v_new, k_old, v_old, metric: str, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token squared L2 deviation, summed over heads. Inputs [H, P, D]; output [P].

    For "kv" each part is normalised by its mean over the rows where `weight` [P] (bool) is True
    (the competing rows; all rows when None); the other rows never enter the means, so unfilled
    cache rows there cannot turn every score into NaN."""
    dk = (k_new.float() - k_old.float()).pow(2).sum(dim=(0, 2))  # [P]
    if metric == "k":
        return dk
    dv = (v_new.float() - v_old.float()).pow(2).sum(dim=(0, 2))  # [P]
    if metric == "v":
        return dv
    if weight is None:
        weight = torch.ones_like(dk, dtype=torch.bool)  # [P]
    n = weight.sum().clamp_min(1).to(dk.dtype)
    mean_k = torch.where(weight, dk, 0.0).sum() / n  # rows outside `weight` may hold NaN / inf
    mean_v = torch.where(weight, dv, 0.0).sum() / n
    return dk / mean_k.clamp_min(1e-12) + dv / mean_v.clamp_min(1e-12)
