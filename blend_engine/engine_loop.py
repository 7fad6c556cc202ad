"""The engine loop: one thread owns the model and serves every request in continuous batches.

    caller (event loop, or a thread)       the loop thread
    --------------------------------       ---------------
    EngineClient.submit / Generation       each step (`scheduler.batch.BatchScheduler`):
      layout, keys, plan, block hashes ->    drop cancelled, timed-out and too-late requests
      admission (`scheduler.admission`)      grow runs (or preempt the youngest), admit by free
      then wait for deltas            <-     blocks (taking cached prefixes), then ONE pass over
                                             the layers: every decode row and the prefills'
                                             rows under a token budget, one projection and one
                                             MLP call a layer (`layers.layer_pass`)
    run_task(fn) (ingestion precompute) ->   one task between steps
                                             one missed passage's alone-KV stored between steps

Every request's KV lives in a run of the paged pool (`executor.kv_pool.KVPool`): the scheduler
decides the blocks, the loop applies its plan to the tensors. Per request the loop keeps its
prefill run, cache view, sampler, stop decoder and tokens (`_Request`); a failed or cancelled
request leaves the batch at the next step without touching the others. A finished request's result
is handed over at once; the alone-KV of its passages that missed the store is background work
(`storing.PassageStoring`): one passage a loop turn (fewer while prefill work waits), and a new
request that needs one still queued stores it first and is planned again. A preempted request is
prefilled again later and its tokens so far are fed again (not sampled), so it ends as it would
have. A decode step reads the device once (`sampling.read_logits`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from blend_engine.background import Background
from blend_engine.cancel import Cancelled, DeadlineExceeded, StopCheck, never
from blend_engine.errors import InputError
from blend_engine.executor.decode import DecodeRows, check_rows, decode_batch, eager_rows, written
from blend_engine.executor.decode_graphs import DecodeGraphs
from blend_engine.executor.kv_pool import KVPool, block_bytes
from blend_engine.executor.layers import KVCache, LayerLoop, layer_pass
from blend_engine.executor.prefill import PrefillRun, PrefillState
from blend_engine.generation import Delta, Generation
from blend_engine.layout import PromptLayout
from blend_engine.model.cpu_threads import use_cores
from blend_engine.sampling import HostLogits, Sampler, StreamDecoder, read_logits
from blend_engine.scheduler.admission import AdmissionControl, AdmissionLimits, Ticket
from blend_engine.scheduler.batch import Admission, BatchLimits, BatchScheduler, Move, PrefillBudget, SeqSpec
from blend_engine.scheduler.kv_blocks import blocks_for
from blend_engine.scheduler.plans import ModePlan, continue_prefix
from blend_engine.types import BlendResult, SelectionPolicy, TokenLogprob

logger = logging.getLogger(__name__)
STEP_DECODE, STEP_PREFILL = "decode", "prefill"  # a step's kind: decode rows only, or carrying prefill rows


@dataclass(frozen=True)
class Prepared:
    """A request planned on its caller's thread: what the loop needs to start its prefill."""

    layout: PromptLayout
    keys: tuple[str | None, ...]
    mp: ModePlan
    policy: SelectionPolicy
    lookups: tuple[tuple[str, ...], ...] = ()  # block hash chains it may take a cached prefix from
    own: tuple[str, ...] = ()  # the chain its blocks are registered under
    min_hit: int = 1  # the shortest cached prefix worth taking

    def seq(self, rid: int) -> SeqSpec:
        return SeqSpec(rid, self.layout.n_tokens, self.lookups, self.own, self.min_hit)


@dataclass
class _Group:
    """One submitted request's n sequences: admission takes, starts and ends it once."""

    should_stop: StopCheck  # the caller's abort (besides each sequence's `Generation.cancel`)
    timeout_s: float | None
    clock: Callable[[], float]  # the loop's (`EngineLoop.clock`)
    t0: float  # submitted, by `clock`
    live: int  # sequences not ended yet
    started: bool = False  # one of them was admitted to the batch
    queue_s: float = 0.0  # submitted until admitted
    cost_s: float = 0.0  # its share of the loop's step time while in the batch (admission learns it)
    completed: bool = True  # none failed or was cancelled
    places: int = field(init=False)  # its sequences (`live` at submit): the batch places admission counts it for

    def __post_init__(self) -> None:
        self.places = self.live

    @property
    def time_left_s(self) -> float | None:
        return None if self.timeout_s is None else self.timeout_s - self.elapsed_s

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.t0

    @property
    def expired(self) -> bool:
        left = self.time_left_s
        return left is not None and left <= 0


@dataclass
class _Request:
    """The loop's state of one sequence (tensors included); dropped when it ends."""

    rid: int
    handle: Generation
    prep: Prepared
    group: _Group
    t0: float
    cache: KVCache | None = None  # its run of the pool
    active: Prepared | None = None  # the prep its prefill runs (a cached prefix changes the plan)
    run: PrefillRun | None = None
    state: PrefillState | None = None
    sampler: Sampler | None = None
    decoder: StreamDecoder | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    next_token: int = 0
    replay: int | None = None  # after a preemption: the index of the generated token fed again
    waited: set[str] = field(default_factory=set)  # why it waited in the queue (counted once each)

    @property
    def aborted(self) -> bool:
        """Its caller stopped it (the handle's cancel, the request's abort)."""
        return self.handle.cancelled or self.group.should_stop()

    @property
    def stopped(self) -> bool:
        return self.aborted or self.group.expired

    def stop_error(self) -> Cancelled:
        if self.aborted:
            return Cancelled("request cancelled")
        return DeadlineExceeded(f"request exceeded its timeout of {self.group.timeout_s:g} s")


class EngineLoop:
    """Started on first use; `close()` fails what is still queued or running."""

    def __init__(self, engine: Any, limits: BatchLimits) -> None:
        self.engine = engine  # BlendEngine: its runner, chunk cache, loader, controller (duck-typed: no cycle)
        per_block = block_bytes(engine.runner, limits.block_tokens)
        n_blocks = max(1, limits.kv_budget_bytes // per_block)
        self.scheduler = BatchScheduler(limits, n_blocks, per_block)
        self.admission = AdmissionControl(AdmissionLimits(limits.max_queue, limits.max_batch))
        self.pool = KVPool(engine.runner, n_blocks, limits.block_tokens)
        self._graphs: DecodeGraphs | None = None  # CUDA graphs of the decode step over the pool (first use)
        self._cond = threading.Condition()
        self._incoming: deque[_Request] = deque()
        self._requests: dict[int, _Request] = {}
        self._thread: threading.Thread | None = None
        # tasks, missed passages' alone-KV stored after their answers (through the engine's chunk cache, looked
        # up at each call), stepped jobs (the fidelity gate)
        self.background = Background(self._cond, lambda: self._thread,
                                     lambda layout, missing, salt: engine.chunks.store_missing(layout, missing, salt))
        self.storing = self.background.storing
        self._ids = itertools.count()
        self._closed = False
        self.clock: Callable[[], float] = time.monotonic  # deadlines and admission's timing (a seam for tests)
        self.steps = 0  # decode steps run (for stats and tests)
        self.max_batch_seen = 0
        self.fused_steps = 0  # steps whose decode rows shared their layers with prefill rows
        self.max_prefills_seen = 0  # the most prefills that advanced in one step
        # prefill rows summed over the layers they entered (`PrefillBudget`'s unit: a blend's every row below
        # its check layer, its selected rows after): prefill steps' seconds over it are the prefill work's rate
        self.prefill_token_layers = 0
        self.step_seconds = {STEP_DECODE: 0.0, STEP_PREFILL: 0.0}  # wall time of steps, by kind
        self.step_counts = {STEP_DECODE: 0, STEP_PREFILL: 0}
        self.step_cpu_seconds = 0.0  # the process's CPU time while steps ran (/ their wall time: cores kept busy)

    # ================================================================== caller side
    def check_fits(self, n_tokens: int, max_new_tokens: int) -> None:
        """A request that could not finish even alone in the pool is refused before admission."""
        limits, pool = self.scheduler.limits, self.scheduler.pool
        need = blocks_for(n_tokens + max_new_tokens, limits.block_tokens)
        if need > pool.n_blocks:
            raise InputError(f"prompt of {n_tokens} tokens plus {max_new_tokens} new tokens needs {need} KV blocks of "
                             f"{limits.block_tokens} tokens; the KV pool holds {pool.n_blocks} "
                             f"(BLENDSERVE_BATCH_KV_MB); ask for fewer tokens or fewer passages")

    def submit(self, handles: list[Generation], prep: Prepared, should_stop: StopCheck = never,
               timeout_s: float | None = None, ticket: Ticket | None = None) -> None:
        """Queue one request's sequences (one per handle, all of one prompt) on its admission
        `ticket` (if this raises, it stays its taker's to release), or on one taken now
        (`errors.Overloaded`: queue full, or the work ahead would outlast `timeout_s`). A sequence
        stops at the next step once its `handle.cancel()` is called, `should_stop()` is true, or
        `timeout_s` has passed since now (it then fails with `DeadlineExceeded`)."""
        with self._cond:
            if self._closed:
                raise Cancelled("the engine is shutting down")
            (ticket or self.admission.admit(timeout_s)).use()
            group = _Group(should_stop, timeout_s, self.clock, self.clock(), len(handles))
            now = time.perf_counter()
            self._incoming.extend(_Request(next(self._ids), h, prep, group, now) for h in handles)
            self._start()
            self._cond.notify()

    def run_task(self, fn: Callable[[], Any], should_stop: StopCheck | None = None) -> Any:
        """Run `fn` on the loop thread between steps (ingestion's precompute); directly when called
        from the loop itself or before the loop started (`background.Background.run_task`)."""
        return self.background.run_task(fn, should_stop)

    def run_stepped(self, make: Callable[[], Any]) -> Any:
        """Advance the generator `make()` one unit a loop turn until it returns (the fidelity gate's
        prefills, a layer at a time: `background.Background.run_stepped`); its return value."""
        return self.background.run_stepped(make)

    def stats(self) -> dict:
        s, pool = self.scheduler, self.scheduler.pool
        return {"running": s.running, "waiting": s.waiting + len(self._incoming), "kv_bytes": s.kv_bytes,
                "queued_requests": self.admission.queued, "running_requests": self.admission.running,
                "decode_steps": self.steps, "max_batch_seen": self.max_batch_seen,
                "fused_steps": self.fused_steps, "max_prefills_seen": self.max_prefills_seen,
                "prefill_token_layers": self.prefill_token_layers,
                "kv_blocks": pool.n_blocks, "kv_blocks_in_use": pool.in_use, "kv_blocks_cached": pool.cached,
                "kv_block_tokens": pool.block_tokens, "kv_blocks_evicted": pool.evictions, "preemptions": s.preemptions,
                "prefix_hit_tokens": s.prefix_hit_tokens,
                "decode_graphs": 0 if self._graphs is None else len(self._graphs.graphs),
                "steps_by_kind": dict(self.step_counts), "step_seconds_by_kind": dict(self.step_seconds),
                "step_cpu_seconds": self.step_cpu_seconds, **self.background.stats()}

    def close(self, timeout_s: float = 10.0) -> None:
        self.admission.close()
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def start(self) -> None:
        """Start the loop thread now rather than at the first request: from then on every task runs on
        it, the one thread that computes on every core (`cpu_threads`; the service calls this)."""
        with self._cond:
            if self._closed:
                raise Cancelled("the engine is shutting down")
            self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    # ================================================================== the loop
    def _loop(self) -> None:
        use_cores()  # the one thread that computes on every core (`cpu_threads`)
        while True:
            with self._cond:
                while (not self._closed and not self._incoming and not self.background.has_work
                       and not self.scheduler.has_work):
                    self._cond.wait()
                if self._closed:
                    break
                incoming = list(self._incoming)
                self._incoming.clear()
            with torch.inference_mode():  # no autograd graph: the weights of a loaded model require grad
                self._enter_batch(incoming)
                batch, t0, c0 = self._batch_groups(), time.perf_counter(), time.process_time()
                kind = None
                try:
                    kind = self._step()
                except Exception:  # noqa: BLE001 - a bug here must not kill the loop silently
                    logger.exception("engine step failed")
                seconds = time.perf_counter() - t0
                self._share(batch | self._batch_groups(), seconds)
                self._timed(kind, seconds, time.process_time() - c0)
                self.background.turn(busy=self._prefill_waits())
        self._fail_all(Cancelled("the engine is shutting down"))

    def _enter_batch(self, incoming: list[_Request]) -> None:
        """Submitted requests join the scheduler. Passages one misses that an earlier answer queued
        for storing are stored first, and its group's sequences planned again to load them."""
        replanned: dict[int, Prepared] = {}  # id of a group's shared prep -> its new plan
        for req in incoming:
            self._requests[req.rid] = req
            if self._guard(req, lambda r: self._replan(r, incoming, replanned)) is not None:
                self.scheduler.add(req.prep.seq(req.rid))

    def _replan(self, req: _Request, incoming: list[_Request], replanned: dict[int, Prepared]) -> Prepared:
        """`req`'s prep, planned again (once per group) when storing its queued passages first made
        them hits."""
        prep = req.prep
        if id(prep) not in replanned:
            replanned[id(prep)] = prep
            if self.storing.store_now(prep.keys[i] for i in prep.mp.missing):
                longest = max(r.handle.gen.max_tokens for r in incoming if r.group is req.group)
                replanned[id(prep)] = self.engine.prepare(req.handle.plan, longest, prep.layout)
        req.prep = replanned[id(prep)]
        return req.prep

    def _prefill_waits(self) -> bool:
        """Prefill work is queued or running: background storing takes a smaller share of the turns."""
        return bool(self.scheduler.waiting) or any(r.state is None for r in self._requests.values())

    def _step(self) -> str | None:
        """One step; its kind (`STEP_PREFILL`: it carried prefill rows, `STEP_DECODE`: decode rows only), or
        None when it ran no rows."""
        for req in [r for r in self._requests.values() if r.stopped]:
            self._drop(req, req.stop_error())
        for req in [r for r in self._requests.values() if self._too_late(r)]:
            self._drop(req, DeadlineExceeded("not started: it could not finish before its deadline"), "dropped_too_late")
        plan = self.scheduler.schedule()
        self._count_wait(plan.held)
        for rid in plan.preempt:
            self._preempt(self._requests[rid])
        for move in plan.moves:
            self._move(self._requests[move.rid], move)
        for adm in plan.admit:
            self._started(self._requests[adm.rid])
            self._guard(self._requests[adm.rid], lambda r, adm=adm: self._begin(r, adm))
        self.scheduler.applied()
        prefilling = [self._requests[rid] for rid in plan.prefill if rid in self._requests]
        decoding = [self._requests[rid] for rid in plan.decode if rid in self._requests]
        if prefilling:
            self._fused(decoding, prefilling, PrefillBudget(plan.prefill_tokens))
            return STEP_PREFILL
        if decoding:
            self._decode(decoding)
            return STEP_DECODE
        return None

    def _timed(self, kind: str | None, seconds: float, cpu_seconds: float) -> None:
        """A step's wall and process CPU time, by kind (`stats`, the service's /metrics)."""
        if kind is not None:
            self.step_counts[kind] += 1
            self.step_seconds[kind] += seconds
            self.step_cpu_seconds += cpu_seconds

    def _guard(self, req: _Request, fn: Callable[[_Request], Any]) -> Any:
        """Run one request's share of a step; its failure (or cancellation) ends it alone."""
        try:
            return fn(req)
        except BaseException as exc:  # noqa: BLE001 - handed to the request's caller
            self._drop(req, exc)
            return None

    # ------------------------------------------------------------------ admission (`scheduler.admission`)
    def _too_late(self, req: _Request) -> bool:
        """Still queued, and its time left is shorter than it would take beside the running ones."""
        g = req.group
        return not g.started and self.admission.too_late(g.time_left_s, g.timeout_s)

    def _count_wait(self, held: tuple[int, str] | None) -> None:
        """The head of the queue waited this step: counted once per request and reason."""
        if held is None or held[0] not in self._requests:
            return
        req = self._requests[held[0]]
        if held[1] not in req.waited:
            req.waited.add(held[1])
            self.admission.waited(held[1])

    def _batch_groups(self) -> dict[int, _Group]:
        """The requests in the batch (started, not ended), each once whatever its n."""
        return {id(r.group): r.group for r in self._requests.values() if r.group.started}

    @staticmethod
    def _share(batch: dict[int, _Group], seconds: float) -> None:
        """A step's time, divided among the requests it served: each one's cost."""
        for g in batch.values():
            g.cost_s += seconds / len(batch)

    def _started(self, req: _Request) -> None:
        g = req.group
        if not g.started:
            g.started, g.queue_s = True, g.elapsed_s
            self.admission.started(g.places)

    def _ended(self, req: _Request, completed: bool, dropped: str | None = None) -> None:
        """One sequence ended; the last of its request tells admission how the request went."""
        g = req.group
        g.live -= 1
        g.completed = g.completed and completed
        if g.live:
            return
        if g.started:
            self.admission.finished(g.cost_s if g.completed else None, g.places)
        else:
            self.admission.left_queue(dropped)

    # ------------------------------------------------------------------ the pool
    def _move(self, req: _Request, move: Move) -> None:
        """The request's run grew: copy its KV when the run moved, else only widen its views."""
        if move.moved:
            self.pool.move(req.cache, move.new)
        else:
            self.pool.rebind(req.cache, move.new)

    def _preempt(self, req: _Request) -> None:
        """Its blocks were taken back: drop its KV and prefill; tokens, sampler and stream stay, so
        that once admitted again it is prefilled anew and its tokens so far are fed again."""
        if req.run is not None and req.state is None:
            req.run.close()
        req.cache = req.run = req.state = req.active = None
        req.replay = None
        logger.info("request %d preempted after %d tokens (KV pool full)", req.rid, len(req.tokens))

    # ------------------------------------------------------------------ prefill
    def _begin(self, req: _Request, adm: Admission) -> None:
        """Start its prefill in its run: a cached prefix copied in first (or adopted in place), and
        then only the rest computed."""
        eng, prep = self.engine, req.prep
        req.cache = self.pool.view(adm.run)
        if adm.copy_from:
            self.pool.copy_prefix(adm.copy_from, adm.run)
        if adm.prefix_tokens:
            prep = replace(prep, mp=continue_prefix(prep.mp, adm.prefix_tokens, prep.layout.n_tokens))
        req.active = prep
        req.run = eng.start_run(req.handle.plan, prep, req.handle.gen.max_tokens, cache=req.cache)

    def _enter(self, req: _Request, layer: int, budget: PrefillBudget) -> LayerLoop | None:
        """The request's rows for this layer of the step (its layer loop, the layer loaded and
        placed), or None: not at this layer, out of budget, or stopped (then dropped)."""
        if req.run.next_layer != layer or req.rid not in self._requests:
            return None
        if req.stopped:  # between layers: a timed-out or abandoned prefill stops here
            self._drop(req, req.stop_error())
            return None
        if not budget.take(req.rid, req.run.rows):
            return None
        return self._guard(req, lambda r: r.run.enter())

    def _prefilled(self, req: _Request) -> None:
        """Its last layer is computed: the first token (or, after a preemption, its tokens fed again)."""
        req.state = self.engine.complete_run(req.handle.plan, req.active, req.run)
        req.handle.state = req.state
        self.scheduler.prefilled(req.rid)
        if req.handle.export is not None and not req.tokens:  # its KV handed to another decoder, once
            req.handle.export(req.cache, req.state)
        if req.tokens:  # prefilled again after a preemption: feed its tokens again, sample nothing
            req.replay, req.next_token = 0, req.tokens[0]
            return
        gen = req.handle.gen
        req.sampler = Sampler(gen.temperature, gen.top_p, gen.seed)
        req.decoder = StreamDecoder(self.engine.runner.tokenizer, gen.stop)
        host = self._read([req], req.state.logits[None, :])  # [1, V]
        self._take(req, host.top[0], host.rows.get(0))  # the first token is out (it may also be the last)

    # ------------------------------------------------------------------ the step's pass over the layers
    def _fused(self, decoding: list[_Request], prefilling: list[_Request], budget: PrefillBudget) -> None:
        """ONE pass over the layers for the whole step: at each layer, the decode rows of every
        decoding request and the rows of every prefill at that layer (within `budget`) go through
        one projection and one MLP call (`layers.layer_pass`), each attending on its own.

            layer l:  | decode rows (B) | prefill 1's rows at l | prefill 2's rows at l | ... |

        A prefill joins at its next layer and leaves when out of budget or done; a prefill's
        failure ends it alone, a failed pass ends everyone in it."""
        r = self.engine.runner
        caches, tokens, pos = self._inputs(decoding)
        rows = self._decode_rows(decoding, caches, tokens, pos) if decoding else None
        if rows is None:
            decoding = []
        for req in prefilling:  # oldest first
            budget.allot(req.rid, req.run.rows * (r.shape.n_layers - req.run.next_layer))
        advanced: set[int] = set()  # the prefills that ran a layer
        shared = False  # decode rows and prefill rows went through a layer together
        for layer in range(r.shape.n_layers):
            entered = [(req, loop) for req in prefilling if (loop := self._enter(req, layer, budget)) is not None]
            groups = ([rows] if rows is not None else []) + [loop for _, loop in entered]
            if not groups:
                continue
            advanced.update(req.rid for req, _ in entered)
            self.prefill_token_layers += sum(req.run.rows for req, _ in entered)
            shared = shared or (rows is not None and bool(entered))
            try:
                layer_pass(r, layer, groups)
            except BaseException as exc:  # noqa: BLE001 - the pass failed for all its members
                for req in decoding + [req for req, _ in entered]:
                    self._drop(req, exc)
                rows, decoding = None, []
                continue
            for req, loop in entered:
                loop.shared = loop.shared or len(groups) > 1
                req.run.leave()
        self.fused_steps += shared
        self.max_prefills_seen = max(self.max_prefills_seen, len(advanced))
        for req in prefilling:
            if req.rid in self._requests and req.run is not None and req.run.done and req.state is None:
                self._guard(req, self._prefilled)
        if rows is not None:
            self._decoded(decoding, lambda: self._finish_rows(rows, caches, pos))

    @staticmethod
    def _inputs(reqs: list[_Request]) -> tuple[list[KVCache], list[int], list[int]]:
        """A decode step's caches, token ids and positions (each next token at its cache's length)."""
        caches = [r.cache for r in reqs]
        return caches, [r.next_token for r in reqs], [c.length for c in caches]

    def _decode_rows(self, reqs: list[_Request], caches: list[KVCache], tokens: list[int],
                     pos: list[int]) -> DecodeRows | None:
        """The decode rows of a fused step (None: building them failed, its members dropped)."""
        try:
            check_rows(caches, tokens, pos)
            return eager_rows(self.engine.runner, caches, tokens, pos, self.engine.config.decode_attention)
        except BaseException as exc:  # noqa: BLE001 - the step failed for all its members
            for r in reqs:
                self._drop(r, exc)
            return None

    @staticmethod
    def _finish_rows(rows: DecodeRows, caches: list[KVCache], pos: list[int]) -> torch.Tensor:
        """After the pass: the decode rows' logits [B, V]; their caches now hold the new tokens."""
        logits = rows.logits()  # [B, V]
        written(caches, pos)
        return logits

    # ------------------------------------------------------------------ decode
    def _decode(self, reqs: list[_Request]) -> None:
        """A step with nothing prefilling: the decode rows alone (as a CUDA graph where captured)."""
        caches, tokens, pos = self._inputs(reqs)
        self._decoded(reqs, lambda: decode_batch(self.engine.runner, caches, tokens, pos,
                                                 self.engine.config.decode_attention, self._decode_graphs()))  # [B, V]

    def _decoded(self, reqs: list[_Request], logits: Callable[[], torch.Tensor]) -> None:
        """The step's logits [B, V] (from `logits()`) read once; each request takes its token."""
        try:
            host = self._read(reqs, logits())
        except BaseException as exc:  # noqa: BLE001 - the step failed for all its members
            for r in reqs:
                self._drop(r, exc)
            return
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(reqs))
        for b, req in enumerate(reqs):
            if self._replayed(req):
                continue
            self._guard(req, lambda r, b=b: self._take(r, host.top[b], host.rows.get(b)))

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The pool's decode graphs, made in this thread on first use: on CUDA unless turned off."""
        if self._graphs is None and self.engine.config.decode_graphs == "auto" and self.engine.runner.device.type == "cuda":
            self._graphs = DecodeGraphs(self.engine.runner, self.pool)
        return self._graphs

    @staticmethod
    def _replayed(req: _Request) -> bool:
        """A preempted request's step that fed one of its earlier tokens again: the next one is
        known. False once the last earlier token is in: this step's logits give a new token."""
        if req.replay is None:
            return False
        req.replay += 1
        if req.replay < len(req.tokens):
            req.next_token = req.tokens[req.replay]
            return True
        req.replay = None
        return False

    @staticmethod
    def _read(reqs: list[_Request], logits: torch.Tensor) -> HostLogits:
        """The step's one device->host read of logits [B, V]: the full row only where a sampler
        draws from it or logprobs are asked for."""
        return read_logits(logits, [not r.sampler.greedy or r.handle.gen.logprobs is not None for r in reqs])

    def _take(self, req: _Request, top: int, row: torch.Tensor | None) -> None:
        """Take the next token (`Sampler.pick` of the row's argmax `top` and its host logits [V]),
        stream it, and end the request when it stops."""
        gen, eos = req.handle.gen, self.engine.runner.eos_token_ids
        tok = req.sampler.pick(top, row)
        if req.handle.ttft_ms is None:
            req.handle.ttft_ms = (time.perf_counter() - req.t0) * 1e3
        if tok in eos and not gen.ignore_eos:
            return self._end(req, "stop")
        req.tokens.append(tok)
        lp = self._logprob(row, tok, gen.logprobs) if gen.logprobs is not None else ()
        req.logprobs.extend(lp)
        text, hit_stop = req.decoder.push(tok)
        if text or lp:
            req.handle.emit(Delta(text, lp))
        if hit_stop:
            return self._end(req, "stop")
        if len(req.tokens) >= gen.max_tokens:
            return self._end(req, "length")
        req.next_token = tok

    def _logprob(self, logits: torch.Tensor, tok: int, k: int) -> tuple[TokenLogprob, ...]:
        """The sampled token's log probability and the k most likely alternatives, from host logits [V]."""
        logp = torch.log_softmax(logits.float(), dim=-1)  # [V]
        text = self.engine.runner.decode
        top = torch.topk(logp, k) if k else None
        alts = tuple((text([int(i)]), float(v)) for v, i in zip(top.values, top.indices)) if top is not None else ()
        return (TokenLogprob(tok, text([tok]), float(logp[tok]), alts),)

    def _end(self, req: _Request, finish: str) -> None:
        """The answer is complete: hand it over now; the passages that missed the store are queued
        for storing after it (`storing.PassageStoring`)."""
        tail = req.decoder.flush()
        if tail:
            req.handle.emit(Delta(tail))
        total_ms = (time.perf_counter() - req.t0) * 1e3
        self.scheduler.finish(req.rid)  # its prompt blocks stay cached in the pool (automatic prefix caching)
        self._requests.pop(req.rid, None)
        self._ended(req, completed=True)
        self._hand_over(req, finish, total_ms)
        self.storing.add(req.state.layout, req.prep.keys, req.state.missing, req.handle.plan.cache_salt)

    def _hand_over(self, req: _Request, finish: str, total_ms: float) -> None:
        state = req.state
        req.handle.end(BlendResult(
            text=req.decoder.text, token_ids=tuple(req.tokens), finish_reason=finish, report=state.report,
            ttft_ms=req.handle.ttft_ms if req.handle.ttft_ms is not None else total_ms, total_ms=total_ms,
            store_ms=0.0, explanation=state.explanation, logprobs=tuple(req.logprobs),
            queue_ms=req.group.queue_s * 1e3))

    # ------------------------------------------------------------------ endings
    def _drop(self, req: _Request, exc: BaseException, why: str | None = None) -> None:
        """End a request that failed or was cancelled (`why`: admission dropped it); the rest of the
        batch is untouched."""
        self.scheduler.finish(req.rid)
        if self._requests.pop(req.rid, None) is not None:  # not when it already ended
            self._ended(req, completed=False, dropped=why)
        if req.run is not None and req.state is None:
            req.run.close()
        if not isinstance(exc, Cancelled):
            logger.warning("request %d failed: %s", req.rid, exc)
        req.handle.fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            pending = list(self._incoming)
            self._incoming.clear()
        for req in list(self._requests.values()):
            self._drop(req, exc)
        for req in pending:  # never reached the loop
            self._drop(req, exc)
            self._ended(req, completed=False)
        self.background.close(exc)


