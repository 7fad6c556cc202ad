"""One engine step's work on the tensors: prefills begun in their runs of the pool, ONE pass over the
layers for every decode row and the prefills' rows, the step's logits read once, each request's
token taken.

    layer l:  | decode rows (B) | prefill 1's rows at l | prefill 2's rows at l | ... |
                 one projection and one MLP call a layer (`layers.layer_pass`), each group
                 attending on its own; a prefill joins at its next layer, leaves when out of
                 budget or done

A step with nothing prefilling runs the decode rows alone (a CUDA graph where captured). A request's
failure ends it alone; a failed pass ends everyone in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from blend_engine.executor.decode import DecodeRows, check_rows, decode_batch, eager_rows, written
from blend_engine.executor.decode_graphs import DecodeGraphs
from blend_engine.executor.kv_pool import KVPool
from blend_engine.executor.layers import KVCache, LayerLoop, layer_pass
from blend_engine.loop.output import TokenOutput
from blend_engine.loop.protocol import EngineSide
from blend_engine.loop.requests import Request, RequestTable
from blend_engine.scheduler.batch import Admission, Move, PrefillBudget
from blend_engine.scheduler.plans import continue_prefix

EndFn = Callable[[Request, str], None]  # the loop's `_end`: hand the answer over


class Stepper:
    """The tensors of a step, for the requests of `table`; `end(req, finish)` hands an answer over."""

    def __init__(self, engine: EngineSide, pool: KVPool, table: RequestTable, output: TokenOutput, end: EndFn,
                 decode_attention: str = "auto", decode_graphs: str = "auto") -> None:
        self.engine, self.pool, self.table, self.output, self.end = engine, pool, table, output, end
        self.decode_attention, self.graphs_mode = decode_attention, decode_graphs
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of the decode step over the pool (first use)
        self.steps = 0  # decode steps run (for stats and tests)
        self.max_batch_seen = 0
        self.fused_steps = 0  # steps whose decode rows shared their layers with prefill rows
        self.max_prefills_seen = 0  # the most prefills that advanced in one step
        # prefill rows summed over the layers they entered (`PrefillBudget`'s unit: a blend's every row below
        # its check layer, its selected rows after): prefill steps' seconds over it are the prefill work's rate
        self.prefill_token_layers = 0

    # ------------------------------------------------------------------ the pool
    def move(self, req: Request, move: Move) -> None:
        """The request's run grew: copy its KV when the run moved, else only widen its views."""
        if move.moved:
            self.pool.move(req.cache, move.new)
        else:
            self.pool.rebind(req.cache, move.new)

    def begin(self, req: Request, adm: Admission) -> None:
        """Start its prefill in its run: a cached prefix copied in first (or adopted in place), and
        then only the rest computed."""
        prep = req.prep
        req.cache = self.pool.view(adm.run)
        if adm.copy_from:
            self.pool.copy_prefix(adm.copy_from, adm.run)
        if adm.prefix_tokens:
            prep = replace(prep, mp=continue_prefix(prep.mp, adm.prefix_tokens, prep.layout.n_tokens))
        req.active = prep
        req.run = self.engine.start_run(req.handle.plan, prep, req.handle.gen.max_tokens, cache=req.cache)

    # ------------------------------------------------------------------ prefill rows
    def _enter(self, req: Request, layer: int, budget: PrefillBudget) -> LayerLoop | None:
        """The request's rows for this layer of the step (its layer loop, the layer loaded and
        placed), or None: not at this layer, out of budget, or stopped (then dropped)."""
        if req.run.next_layer != layer or req.rid not in self.table:
            return None
        if req.stopped:  # between layers: a timed-out or abandoned prefill stops here
            self.table.drop(req, req.stop_error())
            return None
        if not budget.take(req.rid, req.run.rows):
            return None
        return self.table.guard(req, lambda r: r.run.enter())

    def _prefilled(self, req: Request) -> None:
        """Its last layer is computed: the first token (or, after a preemption, its tokens fed again)."""
        req.state = self.engine.complete_run(req.handle.plan, req.active, req.run)
        req.handle.state = req.state
        self.table.scheduler.prefilled(req.rid)
        if req.handle.export is not None and not req.tokens:  # its KV handed to another decoder, once
            req.handle.export(req.cache, req.state)
        if req.tokens:  # prefilled again after a preemption: feed its tokens again, sample nothing
            req.replay, req.next_token = 0, req.tokens[0]
            return
        finish = self.output.first(req)  # the first token is out (it may also be the last)
        if finish is not None:
            self.end(req, finish)

    # ------------------------------------------------------------------ the step's pass over the layers
    def fused(self, decoding: list[Request], prefilling: list[Request], budget: PrefillBudget) -> None:
        """ONE pass over the layers for the whole step: the decode rows of every decoding request and
        the rows of every prefill at that layer (within `budget`, oldest first)."""
        n_layers = self.engine.runner.shape.n_layers
        caches, tokens, pos = _inputs(decoding)
        rows = self._decode_rows(decoding, caches, tokens, pos) if decoding else None
        if rows is None:
            decoding = []
        for req in prefilling:
            budget.allot(req.rid, req.run.rows, n_layers - req.run.next_layer)
        advanced: set[int] = set()  # the prefills that ran a layer
        shared = False  # decode rows and prefill rows went through a layer together
        for layer in range(n_layers):
            entered = [(req, loop) for req in prefilling if (loop := self._enter(req, layer, budget)) is not None]
            if rows is None and not entered:
                continue
            advanced.update(req.rid for req, _ in entered)
            shared = shared or (rows is not None and bool(entered))
            if not self._layer(layer, rows, entered, decoding):
                rows, decoding = None, []
        self.fused_steps += shared
        self.max_prefills_seen = max(self.max_prefills_seen, len(advanced))
        for req in prefilling:
            if req.rid in self.table and req.run is not None and req.run.done and req.state is None:
                self.table.guard(req, self._prefilled)
        if rows is not None:
            self._decoded(decoding, lambda: _finish_rows(rows, caches, pos))

    def _layer(self, layer: int, rows: DecodeRows | None, entered: list[tuple[Request, LayerLoop]],
               decoding: list[Request]) -> bool:
        """One layer of the fused pass; False when it failed (everyone in it dropped)."""
        groups = ([rows] if rows is not None else []) + [loop for _, loop in entered]
        self.prefill_token_layers += sum(req.run.rows for req, _ in entered)
        try:
            layer_pass(self.engine.runner, layer, groups)
        except BaseException as exc:  # noqa: BLE001 - the pass failed for all its members
            for req in decoding + [req for req, _ in entered]:
                self.table.drop(req, exc)
            return False
        for req, loop in entered:
            loop.shared = loop.shared or len(groups) > 1
            req.run.leave()
        return True

    def _decode_rows(self, reqs: list[Request], caches: list[KVCache], tokens: list[int],
                     pos: list[int]) -> DecodeRows | None:
        """The decode rows of a fused step (None: building them failed, its members dropped)."""
        try:
            check_rows(caches, tokens, pos)
            return eager_rows(self.engine.runner, caches, tokens, pos, self.decode_attention)
        except BaseException as exc:  # noqa: BLE001 - the step failed for all its members
            for r in reqs:
                self.table.drop(r, exc)
            return None

    # ------------------------------------------------------------------ decode
    def decode(self, reqs: list[Request]) -> None:
        """A step with nothing prefilling: the decode rows alone (as a CUDA graph where captured)."""
        caches, tokens, pos = _inputs(reqs)
        self._decoded(reqs, lambda: decode_batch(self.engine.runner, caches, tokens, pos, self.decode_attention,
                                                 self._decode_graphs()))  # [B, V]

    def _decoded(self, reqs: list[Request], logits: Callable[[], torch.Tensor]) -> None:
        """The step's logits [B, V] (from `logits()`) read once; each request takes its token."""
        try:
            host = self.output.read(reqs, logits())
        except BaseException as exc:  # noqa: BLE001 - the step failed for all its members
            for r in reqs:
                self.table.drop(r, exc)
            return
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(reqs))
        for b, req in enumerate(reqs):
            if req.replayed():
                continue
            self.table.guard(req, lambda r, b=b: self._take(r, host.top[b], host.rows.get(b)))

    def _take(self, req: Request, top: int, row: torch.Tensor | None) -> None:
        """The request's next token (`TokenOutput.take`); its answer handed over when that ended it."""
        finish = self.output.take(req, top, row)
        if finish is not None:
            self.end(req, finish)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The pool's decode graphs, made in this thread on first use: on CUDA unless turned off."""
        runner = self.engine.runner
        if self.graphs is None and self.graphs_mode == "auto" and runner.device.type == "cuda":
            self.graphs = DecodeGraphs(runner, self.pool)
        return self.graphs


def _inputs(reqs: list[Request]) -> tuple[list[KVCache], list[int], list[int]]:
    """A decode step's caches, token ids and positions (each next token at its cache's length)."""
    caches = [r.cache for r in reqs]
    return caches, [r.next_token for r in reqs], [c.length for c in caches]


def _finish_rows(rows: DecodeRows, caches: list[KVCache], pos: list[int]) -> torch.Tensor:
    """After the pass: the decode rows' logits [B, V]; their caches now hold the new tokens."""
    logits = rows.logits()  # [B, V]
    written(caches, pos)
    return logits
