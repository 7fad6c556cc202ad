"""The engine loop: one thread owns the model and serves every request in continuous batches.

    caller (event loop, or a thread)       the loop thread
    --------------------------------       ---------------
    EngineClient.submit / Generation       each step (`scheduler.batch.BatchScheduler`):
      layout, keys, plan, block hashes ->    drop cancelled, timed-out and too-late requests
      admission (`scheduler.admission`)      grow runs (or preempt the youngest), admit by free
      then wait for deltas            <-     blocks (taking cached prefixes), then ONE pass over
                                             the layers: every decode row and the prefills'
                                             rows within a budget (tokens, a time target),
                                             one projection and one MLP call a layer
                                             (`layers.layer_pass`)
    run_task(fn) (ingestion precompute) ->   one task between steps
                                             background units (a layer of a missed passage's
                                             alone-KV, of a gate prefill): a bounded share

The loop only orders the work; its rooms do it:

- `requests`: a request's life (queued, admitted, preempted and replayed, ended) and what admission
  and the scheduler are told (`RequestTable`);
- `stepper`: a step's tensors: prefills begun in their runs of the paged pool
  (`executor.kv_pool.KVPool`), the one pass over the layers, the decode step (`Stepper`);
- `output`: from logits to tokens, text, logprobs and results (`TokenOutput`);
- `background`: tasks (ingestion's precompute), missed passages' alone-KV stored after their answers
  (`storing.PassageStoring`) and stepped jobs (the start-up fidelity gate), between steps.

The scheduler decides the blocks, the stepper applies its plan to the tensors. A failed or cancelled
request leaves the batch at the next step without touching the others. A finished request's result is
handed over at once; a new request that needs a passage still queued for storing stores it first and
is planned again, unless the passage lies in the cached prefix it takes from the pool (an exact
repeat). A decode step reads the device once (`sampling.read_logits`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from blend_engine.cancel import Cancelled, StopCheck, never
from blend_engine.errors import InputError
from blend_engine.executor.kv_pool import KVPool, block_bytes
from blend_engine.generation import Generation
from blend_engine.loop.background import Background
from blend_engine.loop.output import TokenOutput
from blend_engine.loop.protocol import EngineSide
from blend_engine.loop.requests import Group, Prepared, Request, RequestTable
from blend_engine.loop.stepper import Stepper
from blend_engine.model.cpu_threads import use_cores
from blend_engine.scheduler.admission import AdmissionControl, AdmissionLimits, Ticket
from blend_engine.scheduler.batch import BatchLimits, BatchScheduler, PrefillBudget
from blend_engine.scheduler.kv_blocks import blocks_for
from blend_engine.steps import Steps

logger = logging.getLogger(__name__)
STEP_DECODE, STEP_PREFILL = "decode", "prefill"  # a step's kind: decode rows only, or carrying prefill rows


class EngineLoop:
    """Started on first use; `close()` fails what is still queued or running."""

    def __init__(self, engine: EngineSide, limits: BatchLimits, decode_attention: str = "auto",
                 decode_graphs: str = "auto") -> None:
        self.engine = engine
        per_block = block_bytes(engine.runner, limits.block_tokens)
        n_blocks = max(1, limits.kv_budget_bytes // per_block)
        self.scheduler = BatchScheduler(limits, n_blocks, per_block)
        self.pool = KVPool(engine.runner, n_blocks, limits.block_tokens)
        self.requests = RequestTable(self.scheduler, AdmissionControl(AdmissionLimits(limits.max_queue,
                                                                                      limits.max_batch)))
        self.stepper = Stepper(engine, self.pool, self.requests, TokenOutput(engine.runner), self._end,
                               decode_attention, decode_graphs)
        self._cond = threading.Condition()
        self._incoming: deque[Request] = deque()
        self._thread: threading.Thread | None = None
        # tasks, missed passages' alone-KV stored after their answers (through the engine's chunk cache, looked
        # up at each call), stepped jobs (the fidelity gate)
        self.background = Background(self._cond, lambda: self._thread,
                                     lambda token_ids, salt: engine.chunks.store_steps(token_ids, salt))
        self.storing = self.background.storing
        self._ids = itertools.count()
        self._closed = False
        self.clock: Callable[[], float] = time.monotonic  # deadlines and admission's timing (a seam for tests)
        self.step_seconds = {STEP_DECODE: 0.0, STEP_PREFILL: 0.0}  # wall time of steps, by kind
        self.step_counts = {STEP_DECODE: 0, STEP_PREFILL: 0}
        self.step_cpu_seconds = 0.0  # the process's CPU time while steps ran (/ their wall time: cores kept busy)

    @property
    def admission(self) -> AdmissionControl:
        """The one admission point (`scheduler.admission`), which the request table tells how requests went."""
        return self.requests.admission

    @admission.setter
    def admission(self, admission: AdmissionControl) -> None:  # a seam for tests: a fixed cost per request
        self.requests.admission = admission

    @property
    def steps(self) -> int:
        """Decode steps run (for stats and tests)."""
        return self.stepper.steps

    @property
    def max_batch_seen(self) -> int:
        return self.stepper.max_batch_seen

    # ================================================================== caller side
    def check_fits(self, n_tokens: int, max_new_tokens: int) -> None:
        """A request that could not finish even alone in the pool is refused before admission."""
        limits, pool = self.scheduler.limits, self.scheduler.pool
        need = blocks_for(n_tokens + max_new_tokens, limits.block_tokens)
        if need > pool.n_blocks:
            raise InputError(f"prompt of {n_tokens} tokens plus {max_new_tokens} new tokens needs {need} KV blocks of "
                             f"{limits.block_tokens} tokens; the KV pool holds {pool.n_blocks} "
                             f"(BLENDSERVE_ENGINE_BATCH_KV_MB); ask for fewer tokens or fewer passages")

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
            group = Group(should_stop, timeout_s, self.clock, self.clock(), len(handles))
            now = time.perf_counter()
            self._incoming.extend(Request(next(self._ids), h, prep, group, now) for h in handles)
            self._start()
            self._cond.notify()

    def run_task(self, fn: Callable[[], Any], should_stop: StopCheck | None = None) -> Any:
        """Run `fn` on the loop thread between steps (ingestion's precompute); directly when called
        from the loop itself or before the loop started (`background.Background.run_task`)."""
        return self.background.run_task(fn, should_stop)

    def run_stepped(self, make: Callable[[], Steps]) -> Any:
        """Advance the generator `make()` one unit a loop turn until it returns (the fidelity gate's
        prefills, a layer at a time: `background.Background.run_stepped`); its return value."""
        return self.background.run_stepped(make)

    def wake(self) -> None:
        """Wake the loop to look for work again (after a seam such as `storing.paused` changed)."""
        with self._cond:
            self._cond.notify()

    def stats(self) -> dict:
        s, pool, st = self.scheduler, self.scheduler.pool, self.stepper
        return {"running": s.running, "waiting": s.waiting + len(self._incoming), "kv_bytes": s.kv_bytes,
                "queued_requests": self.admission.queued, "running_requests": self.admission.running,
                "decode_steps": st.steps, "max_batch_seen": st.max_batch_seen,
                "fused_steps": st.fused_steps, "max_prefills_seen": st.max_prefills_seen,
                "prefill_token_layers": st.prefill_token_layers,
                "prefill_step_budget": s.step_time.units(s.limits.prefill_step_tokens),
                "kv_blocks": pool.n_blocks, "kv_blocks_in_use": pool.in_use, "kv_blocks_cached": pool.cached,
                "kv_block_tokens": pool.block_tokens, "kv_blocks_evicted": pool.evictions, "preemptions": s.preemptions,
                "prefix_hit_tokens": s.prefix_hit_tokens,
                "decode_graphs": 0 if st.graphs is None else len(st.graphs.graphs),
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
                    self._cond.wait(self.background.wait_s())  # held units: until they may run
                if self._closed:
                    break
                incoming = list(self._incoming)
                self._incoming.clear()
            with torch.inference_mode():  # no autograd graph: the weights of a loaded model require grad
                self._turn(incoming)
        with self._cond:
            pending = list(self._incoming)
            self._incoming.clear()
        self.requests.drop_all(Cancelled("the engine is shutting down"), pending)
        self.background.close(Cancelled("the engine is shutting down"))

    def _turn(self, incoming: list[Request]) -> None:
        """One loop turn: the new requests join, one step runs (timed, its time shared by the batch),
        then one unit of background work."""
        self._enter_batch(incoming)
        batch, t0, c0 = self.requests.batch_groups(), time.perf_counter(), time.process_time()
        kind, units = None, 0
        try:
            kind, units = self._step()
        except Exception:  # noqa: BLE001 - a bug here must not kill the loop silently
            logger.exception("engine step failed")
        seconds = time.perf_counter() - t0
        self.requests.share(batch | self.requests.batch_groups(), seconds)
        self._timed(kind, seconds, time.process_time() - c0, units)
        # idle: no request queued or in the batch, or none could run a row this step
        idle = kind is None or (not self.scheduler.has_work and not self._incoming)
        self.background.turn(seconds, busy=self.requests.prefill_waits(), idle=idle)

    def _enter_batch(self, incoming: list[Request]) -> None:
        """Submitted requests join the scheduler. Passages one misses that an earlier answer queued
        for storing are stored first, and its group's sequences planned again to load them."""
        replanned: dict[int, Prepared] = {}  # id of a group's shared prep -> its new plan
        for req in incoming:
            self.requests.add(req)
            if self.requests.guard(req, lambda r: self._replan(r, incoming, replanned)) is not None:
                self.scheduler.add(req.prep.seq(req.rid))

    def _replan(self, req: Request, incoming: list[Request], replanned: dict[int, Prepared]) -> Prepared:
        """`req`'s prep, planned again (once per group) when storing its queued passages first made
        them hits. Passages inside the cached prefix it will take from the pool are not waited for
        (an exact repeat: their KV is there already; they stay queued for the background)."""
        prep = req.prep
        if id(prep) not in replanned:
            replanned[id(prep)] = prep
            covered = self.scheduler.cached_prefix_tokens(prep.seq(req.rid))
            needed = [i for i in prep.mp.missing if prep.layout.segments[i].end > covered]
            if self.storing.store_now(prep.keys[i] for i in needed):
                longest = max(r.handle.gen.max_tokens for r in incoming if r.group is req.group)
                replanned[id(prep)] = self.engine.prepare(req.handle.plan, longest, prep.layout)
        req.prep = replanned[id(prep)]
        return req.prep

    def _step(self) -> tuple[str | None, int]:
        """One step: its kind (`STEP_PREFILL`: it carried prefill rows, `STEP_DECODE`: decode rows only,
        None: it ran no rows) and the prefill work it carried beside decode rows (`PrefillBudget`'s units)."""
        table, stepper = self.requests, self.stepper
        table.drop_stopped()
        plan = self.scheduler.schedule()
        table.count_wait(plan.held)
        for rid in plan.preempt:
            table[rid].preempted()
        for move in plan.moves:
            stepper.move(table[move.rid], move)
        for adm in plan.admit:
            table.started(table[adm.rid])
            table.guard(table[adm.rid], lambda r, adm=adm: stepper.begin(r, adm))
        self.scheduler.applied()
        prefilling, decoding = table.pick(plan.prefill), table.pick(plan.decode)
        if prefilling:
            budget = PrefillBudget(plan.prefill_tokens, self.scheduler.limits.prefill_layer_overhead)
            stepper.fused(decoding, prefilling, budget)
            return STEP_PREFILL, (plan.copied + budget.spent if decoding else 0)
        if decoding:
            stepper.decode(decoding)
            return STEP_DECODE, 0
        return None, 0

    def _timed(self, kind: str | None, seconds: float, cpu_seconds: float, units: int) -> None:
        """A step's wall and process CPU time, by kind (`stats`, the service's /metrics); what the
        scheduler learns from it about prefill work's cost (`scheduler.step_time`)."""
        if kind is None:
            return
        self.step_counts[kind] += 1
        self.step_seconds[kind] += seconds
        self.step_cpu_seconds += cpu_seconds
        if kind == STEP_DECODE:
            self.scheduler.step_time.decode_step(seconds)
        elif units:
            self.scheduler.step_time.prefill_step(seconds, units)

    def _end(self, req: Request, finish: str) -> None:
        """The answer is complete: hand it over now; the passages that missed the store are queued
        for storing after it (`storing.PassageStoring`)."""
        result = TokenOutput.result(req, finish)
        self.requests.finish(req)  # its prompt blocks stay cached in the pool (automatic prefix caching)
        req.handle.end(result)
        self.storing.add(req.state.layout, req.prep.keys, req.state.missing, req.handle.plan.cache_salt)
