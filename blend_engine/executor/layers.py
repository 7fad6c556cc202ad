"""The layer loop: one pass over every layer, placing loaded KV and recomputing selected tokens.

    | sys | chunk_1 .. chunk_k | question |

Per layer: take the next loaded layer from the stream (if any), place it (`placement.Placer`),
recompute the positions of the current selection (all of them below a blend's check layer),
write their fresh K/V over the placed ones and attend. At the check layer and the schedule's
layers the selection narrows (`selection.RankSpace`). Nothing inside the loop reads a device
value on the host: the caller reads the final positions once, after it.

A layer runs in three phases (`LayerLoop.enter`, `layer_pass`, `LayerLoop.leave`) so that one
`layer_pass` can carry several row groups at once: the engine loop's step puts the decode rows
and every prefill at that layer through one projection and one MLP call, each group attending on
its own (`RowGroup`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from blend_engine.cancel import StopCheck, stop_if
from blend_engine.executor.ape import ape_attend
from blend_engine.executor.placement import Placer
from blend_engine.executor.selection import RankSpace, Selection, cpu_kernel
from blend_engine.explain import ScoreProbe
from blend_engine.kv_store import ChunkKV
from blend_engine.layout import PromptLayout, Segment
from blend_engine.model import cpu_kernels
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.budget import narrowing
from blend_engine.transfer import PackedLayer, cuda_ready
from blend_engine.types import SelectionPolicy

# The one seam of `dispatch_count` (issue #57): while a count runs, it is told which layer and
# phase ("load", "place", "pass"; None: outside the loop) the ops that follow belong to. Serving
# never sets it: a mark is then one test of a module global.
LayerMark = Callable[[int | None, str], None]
_watch: LayerMark | None = None


def watch_layers(mark: LayerMark | None) -> None:
    """`mark(layer, phase)` at every layer boundary from now on (None: stop)."""
    global _watch
    _watch = mark


def _mark(layer: int | None, phase: str) -> None:
    if _watch is not None:
        _watch(layer, phase)


class KVCache:
    """Per-request blended cache. k[l], v[l]: [H, capacity, D]; positions 0..length-1 are valid.
    Its own tensors, or views of a run of the paged pool (`kv_pool.KVPool.view`)."""

    def __init__(self, n_layers: int, n_kv_heads: int, capacity: int, head_dim: int, dtype, device) -> None:
        shape = (n_kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]  # L x [H, C, D]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]  # L x [H, C, D]
        self.length = 0
        self.capacity = capacity
        self.pool: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # a pool run's: the pool's K, V
        self.offset = 0  # a pool run's: the pool slot of position 0

    @classmethod
    def over(cls, k: list[torch.Tensor], v: list[torch.Tensor], capacity: int) -> KVCache:
        """A cache over existing per-layer tensors (views) of [H, capacity, D]."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.length, cache.capacity = k, v, 0, capacity
        cache.pool, cache.offset = None, 0
        return cache

    def segment(self, start: int, end: int) -> ChunkKV:
        k = torch.stack([kl[:, start:end] for kl in self.k])  # [L, H, T, D]
        v = torch.stack([vl[:, start:end] for vl in self.v])  # [L, H, T, D]
        return ChunkKV(k, v)


@dataclass
class Timer:
    """Host seconds of one prefill, summed over layers."""

    assemble: float = 0.0
    wait: float = 0.0


class LayerHooks:
    """The layer loop's seams for research runs (benchmarks/ overrides them); serving runs
    these defaults, which do what the policy says."""

    def narrowing(self, default: dict[int, float], check_layer: int, blend: bool) -> dict[int, float]:
        """layer -> multiplier where the selection is made or narrowed."""
        return default

    def placed(self, layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
        """After a layer's cached K/V are placed in K, V [H, C, D], before it is computed."""

    def select(self, layer: int, ranked: RankSpace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               K: torch.Tensor, V: torch.Tensor, job: LayerJob, current: torch.Tensor | None,
               multiplier: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the positions kept [S'], their rows among the current ones [S']): CacheBlend's selection."""
        return ranked.select_rows(q, k, v, K, V, job.ratio, job.policy, current, multiplier)


SERVING = LayerHooks()


@dataclass(frozen=True)
class LayerJob:
    """What one pass over the layers does.

    - recompute given: only those positions [S] are ever recomputed (full_reuse, prefix_cache).
    - check_layer given (blend): layers 0..check_layer recompute every token; at check_layer the
      selection is made from deviations, then narrowed per the policy's schedule.
    - neither: plain causal prefill of every token (full_prefill, precompute).
    Cached segments are stored at 0..T-1 and moved to their offset by RoPE (`placement.Placer`).
    """

    ids: torch.Tensor  # [N] prompt token ids on the device
    extra: int = 0  # room for new tokens after the prompt
    cached: tuple[Segment, ...] = ()  # segments whose KV arrives, in order, from `stream`
    stream: Iterable[PackedLayer] | None = None
    recompute: torch.Tensor | None = None  # [S]
    check_layer: int | None = None
    ratio: float = 0.0
    policy: SelectionPolicy | None = None
    layout: PromptLayout | None = None  # blend: which positions compete
    probe: ScoreProbe | None = None  # explain: keeps the check layer's scores
    attention: str = "auto"  # how selected rows attend (`selection.Selection`)
    timer: Timer = field(default_factory=Timer)  # accumulates host time (the job itself is not changed)
    hooks: LayerHooks = SERVING  # research runs override the selection (benchmarks/)
    cache: KVCache | None = None  # write here (a pool run of capacity >= N) instead of a cache of its own


@dataclass(frozen=True)
class LayerOutput:
    """The filled cache, the last position's hidden state [1, E], the final selection [S] on the
    device (None: every position), the selection size per layer and the per-layer clock."""

    cache: KVCache
    last_hidden: torch.Tensor
    selected: torch.Tensor | None
    sizes: tuple[int, ...]
    clock: LayerClock


class LayerClock:
    """Per-layer compute time: CUDA events on CUDA (read once, after the loop), perf_counter elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = cuda_ready(device)
        self._marks: list = []

    def mark(self) -> None:
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append(ev)
        else:
            self._marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds from each even mark to the next (start, stop pairs); for CUDA events the one
        host wait is here, after the loop."""
        starts, stops = self._marks[0::2], self._marks[1::2]
        if self._cuda and stops:
            stops[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(starts, stops)]
        return [b - a for a, b in zip(starts, stops)]


def run_layers(runner: ModelRunner, job: LayerJob, should_stop: StopCheck | None = None,
               what: str = "a pass") -> LayerOutput:
    """Run every layer once (see `LayerJob`). At the last layer only the last position's output
    is needed (its logits), so only it attends and runs the MLP there; every selected token's K/V
    are still written. Raises `Cancelled` before a layer once `should_stop()` is true."""
    loop = LayerLoop(runner, job)
    steps = loop.steps()  # one layer per step
    for layer in range(runner.shape.n_layers):
        stop_if(should_stop, f"at layer {layer} of {what}")
        next(steps)
    return loop.output()


class LayerLoop:
    """The state of one pass: the current selection (None = every position) and hidden states.
    `steps()` runs one layer per step, so a scheduler can interleave other work between layers."""

    def __init__(self, r: ModelRunner, job: LayerJob) -> None:
        self.r, self.job = r, job
        self.n = N = job.ids.shape[0]
        self.cache = job.cache or KVCache(r.shape.n_layers, r.shape.n_kv_heads, N + job.extra, r.shape.head_dim,
                                          r.dtype, r.device)
        if self.cache.capacity < N:
            raise ValueError(f"a cache of {self.cache.capacity} positions cannot hold a prompt of {N}")
        self.cache.length = N
        self.pos = torch.arange(N, device=job.ids.device)  # [N]
        self.cos_all, self.sin_all = r.rope(self.pos)  # [N, D] each
        self.windows = r.window_masks(self.pos, N)  # layer -> [N, N] or None, one per window size
        self.kernel = cpu_kernel(job.attention, r.device, r.dtype, r.shape.head_dim)  # rows attend by the C++ kernel
        self.sel = None if job.recompute is None else self._selection(job.recompute)  # None = all tokens
        self.hidden = r.embed(job.ids if self.sel is None else job.ids[self.sel.pos])  # [N or S, E]
        policy = job.policy or SelectionPolicy()
        self.ranked = (RankSpace(job.layout, list(job.cached), r.scaling, policy.sink_tokens, job.ids.device, job.probe,
                                 end_tokens=policy.end_tokens)
                       if job.check_layer is not None else None)
        # layer -> multiplier where the selection is made or narrowed
        self.narrowing = job.hooks.narrowing(narrowing(policy), policy.check_layer, self.ranked is not None)
        self.passage_keys = None  # APE (`ape.py`): the cached passages' positions [N] bool, when the policy asks
        if self.ranked is not None and (policy.ape_temperature != 1.0 or policy.ape_scale != 1.0):
            self.passage_keys = self.ranked.pid < len(self.ranked.passages)  # [N] bool
        self.placer = Placer(r, list(job.cached))
        self.clock = LayerClock(r.device)
        self.sizes: list[int] = []
        self.layer = 0  # the next layer to run
        self.shared = False  # a layer's pass carried other rows (the per-layer clock counts them too)
        self._layers = iter(job.stream) if job.stream is not None else None  # the loaded layers, in order

    def _selection(self, positions: torch.Tensor) -> Selection:
        return Selection(positions, self.cos_all, self.sin_all, self.n, self.r.window_masks, attention=self.job.attention,
                         kernel=self.kernel)

    def steps(self) -> Iterator[int]:
        """Run the layers one per step; each step yields the number of tokens that layer computed."""
        while self.layer < self.r.shape.n_layers:
            layer = self.enter()
            layer_pass(self.r, layer, [self])
            yield self.leave()

    # ---------------------------------------------------------------- one layer, in three phases
    # enter (load and place the layer's cached K/V), then `layer_pass` runs the projections and
    # the MLP over this loop's rows, alone or beside other row groups (the engine's fused step),
    # calling `attend` for this loop's attention; leave records the layer.
    def enter(self) -> int:
        """Take and place the next layer's cached K/V; the layer index (its compute follows)."""
        timer, layer = self.job.timer, self.layer
        _mark(layer, "load")
        t0 = time.perf_counter()
        packed = next(self._layers) if self._layers is not None else None
        t1 = time.perf_counter()
        timer.wait += t1 - t0
        _mark(layer, "place")
        K, V = self.cache.k[layer], self.cache.v[layer]  # [H, C, D] each
        if packed is not None and not self._all_overwritten(layer):
            self.placer.place(K, V, packed)  # below the check layer everything is overwritten anyway
        self.job.hooks.placed(layer, K, V)
        timer.assemble += time.perf_counter() - t1
        _mark(None, "")
        self.clock.mark()
        return layer

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of the rows this layer recomputes (`hidden`'s)."""
        return (self.cos_all, self.sin_all) if self.sel is None else (self.sel.cos, self.sel.sin)

    def leave(self) -> int:
        """The layer is computed (`hidden` holds its output): the tokens it computed."""
        self.sizes.append(self.n if self.sel is None else self.sel.pos.shape[0])
        self.clock.mark()
        self.layer += 1
        return self.sizes[-1]

    def output(self) -> LayerOutput:
        """After the last step: the filled cache, the last hidden state, the final selection."""
        selected = None if self.sel is None else self.sel.pos  # [S]
        return LayerOutput(self.cache, self.hidden[-1:], selected, tuple(self.sizes), self.clock)

    def _all_overwritten(self, layer: int) -> bool:
        return self.sel is None and self.job.check_layer is not None and layer < self.job.check_layer

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Fresh q [Hq, T, D], k, v [H, T, D] of `hidden`'s rows at `layer`: select (at the check
        layer and the schedule's), write their K/V into the cache and attend. `hidden` keeps the
        rows that go on; returns their attention output [T', Hq*D]."""
        r, N = self.r, self.n
        K, V = self.cache.k[layer], self.cache.v[layer]  # [H, C, D] each
        q = self._write_all(layer, q, k, v, K, V) if self.sel is None else self._write_selected(layer, q, k, v, K, V)
        last = layer == r.shape.n_layers - 1
        if last:  # only the last position's output is used: it alone attends, to every key
            q, self.hidden = q[:, -1:], self.hidden[-1:]  # [Hq, 1, D], [1, E]
            out = r.attend(q, K[:, :N], V[:, :N], r.window_mask(layer, self.pos[-1:], N))  # [1, Hq*D]
        elif self.sel is None and self.kernel and not r.causal_on_sdpa(layer, N):
            out = cpu_kernels.selected_attention(q, K[:, :N], V[:, :N], self.pos, r.windows[layer], r.scaling)  # [N, Hq*D]
        elif self.sel is None:
            out = r.attend(q, K[:, :N], V[:, :N], self.windows(layer), causal=True)  # [N, Hq*D]
        else:
            out = self.sel.attend(r, q, K, V, layer)  # [S, Hq*D]
        if self.passage_keys is not None:
            out = self._ape_rows(layer, q, K, V, out, 1 if last else self.ranked.n_query)  # [S or N, Hq*D]
        return out

    def _ape_rows(self, layer: int, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, out: torch.Tensor,
                  rows: int) -> torch.Tensor:
        """APE: the question's rows (the last `rows` of q [Hq, S, D] and out [S, Hq*D]; the question
        is always recomputed and ends the prompt) attend again with the passages' block reweighted."""
        N, policy = self.n, self.job.policy
        allowed = self.r.allowed_keys(layer, self.pos[N - rows:], N)  # [rows, N]
        ape = ape_attend(q[:, -rows:], K[:, :N], V[:, :N], allowed, self.passage_keys, self.r.scaling,
                         policy.ape_temperature, policy.ape_scale)  # [rows, Hq*D]
        return torch.cat([out[:-rows], ape])  # [S, Hq*D]

    def _write_all(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, K: torch.Tensor,
                   V: torch.Tensor) -> torch.Tensor:
        """Every position's K/V written; at a blend's check layer, select and keep only the chosen
        rows of q and `hidden`."""
        job, N = self.job, self.n
        if job.check_layer is not None and layer == job.check_layer:
            picked, rows = job.hooks.select(layer, self.ranked, q, k, v, K, V, job, None, self.narrowing[layer])  # [S]
            self.sel = self._selection(picked)
            q, self.hidden = q[:, rows], self.hidden[rows]  # [Hq, S, D], [S, E]
        K[:, :N], V[:, :N] = k, v
        return q

    def _write_selected(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, K: torch.Tensor,
                        V: torch.Tensor) -> torch.Tensor:
        """The selected positions' K/V written; at a schedule layer, narrow the selection after."""
        job, sel = self.job, self.sel
        keep = None
        if self.ranked is not None and layer in self.narrowing:
            narrowed, keep = job.hooks.select(layer, self.ranked, q, k, v, K, V, job, sel.pos,
                                              self.narrowing[layer])  # [S'] each
        K[:, sel.pos], V[:, sel.pos] = k, v
        if keep is not None:
            q, self.hidden = q[:, keep], self.hidden[keep]  # [Hq, S', D], [S', E]
            self.sel = self._selection(narrowed)
        return q


class RowGroup(Protocol):
    """Rows that go through a layer together with others (`layer_pass`): a prefill's (`LayerLoop`)
    or a decode step's (`decode.DecodeRows`)."""

    hidden: torch.Tensor  # [T, E]: the rows' input to the layer, then (set by `layer_pass`) its output

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def layer_pass(r: ModelRunner, layer: int, groups: Sequence[RowGroup]) -> None:
    """One layer over every group's rows: ONE q/k/v projection and ONE o_proj + MLP call over the
    rows of all groups concatenated, and each group's own attention between them.

        rows:  | group 1's T_1 rows | group 2's T_2 rows | ... |

    A group may keep fewer rows than it came with (`attend` narrows its `hidden`: a blend's
    selection, a prefill's last layer); its output rows are handed back to it. One group alone
    runs without a copy (the decode step's CUDA graphs capture that path)."""
    _mark(layer, "pass")
    if len(groups) == 1:
        g = groups[0]
        q, k, v = r.qkv(layer, g.hidden, *g.rope(layer))  # [Hq, T, D], [H, T, D], [H, T, D]
        out = g.attend(layer, q, k, v)  # [T', Hq*D]
        g.hidden = r.finish_layer(layer, g.hidden, out)  # [T', E]
    else:
        _fused_pass(r, layer, groups)
    _mark(None, "")


def _fused_pass(r: ModelRunner, layer: int, groups: Sequence[RowGroup]) -> None:
    """`layer_pass` over two or more groups: their rows concatenated for the projections and the MLP."""
    ropes = [g.rope(layer) for g in groups]
    inputs = [g.hidden for g in groups]  # [T_i, E] each
    sizes = [h.shape[0] for h in inputs]
    hidden = torch.cat(inputs)  # [sum T, E]
    cos, sin = torch.cat([c for c, _ in ropes]), torch.cat([s for _, s in ropes])  # [sum T, D] each
    q, k, v = r.qkv(layer, hidden, cos, sin)  # [Hq, sum T, D], [H, sum T, D], [H, sum T, D]
    outs = [g.attend(layer, qi, ki, vi) for g, qi, ki, vi in
            zip(groups, q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1))]  # [T_i', Hq*D] each
    kept = [o.shape[0] for o in outs]
    if any(g.hidden is not h for g, h in zip(groups, inputs)):  # a group kept fewer rows: concatenate again
        hidden = torch.cat([g.hidden for g in groups])  # [sum T', E]
    hidden = r.finish_layer(layer, hidden, torch.cat(outs))  # [sum T', E]
    for g, h in zip(groups, hidden.split(kept)):
        g.hidden = h  # [T_i', E]
