"""The blend engine: a thin facade over the scheduler, the executor and the chunk cache.

Token layout of every prompt::

    | sys | passage_1 .. passage_k | question |
      ^cached at 0   ^cached alone at 0..T-1, moved by RoPE   ^never cached

- `scheduler/` (no torch): what each mode loads and recomputes (`plans`), how many tokens each
  layer keeps (`budget`), the ratio controller (`controller`), continuous batching (`batch`).
- `executor/` (every tensor): the layer loop, RoPE placement, CacheBlend selection, one prefill
  (`prefill.PrefillRun`), the batched decode step with explicit positions (`decode`).
- `chunk_cache`: keys, precompute, storing chunks that missed.
- `loop` (`loop.engine_loop.EngineLoop`): the thread that owns the model and batches requests.

The surface: what the service uses (layout and keys, the chunk cache's `precompute` / `cache_*` /
`run_compute` as engine-loop tasks, `prepare`, `start` behind `client.EngineClient`, `close`); `generate`
and `run`, the same path for a blocking caller; `start_run` / `complete_run`, what the loop (and the
fidelity gate's stepped job) drive; and the research and test seam at the end (`prefill`, `decode_step`),
outside the loop.

Modes: full_prefill (nothing loaded), prefix_cache (vLLM's: the longest exact prefix the KV pool
holds, the rest computed), full_reuse (cached chunks concatenated, only uncached tokens recomputed),
blend (CacheBlend: every token up to the check layer, then the selected).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from blend_engine.cancel import StopCheck, never
from blend_engine.chunk_cache import ChunkCache
from blend_engine.executor.attention import check_selected_attention
from blend_engine.executor.decode import check_decode_attention, decode_batch
from blend_engine.executor.layers import SERVING, KVCache, LayerHooks
from blend_engine.executor.prefill import PrefillRun, PrefillState
from blend_engine.generation import Generation
from blend_engine.keys import store_fingerprint
from blend_engine.kv_store import ChunkKV, KVStore
from blend_engine.kv_store.codec import layer_nbytes
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.layout import DEFAULT_SYSTEM_PROMPT, PromptLayout, build_layout
from blend_engine.loop.engine_loop import EngineLoop
from blend_engine.loop.requests import Prepared
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.admission import Ticket
from blend_engine.scheduler.batch import BatchLimits
from blend_engine.scheduler.kv_blocks import NO_PREFIX, chain_hashes, chain_root, min_prefix, recipes
from blend_engine.scheduler.plans import PlanEnv, RatioController, plan_prefill
from blend_engine.types import BlendPlan, BlendResult, GenerationConfig, Mode, SelectionPolicy, default_policy

__all__ = ["BlendEngine", "EngineConfig", "Generation", "KVCache", "PrefillState", "RatioController"]

T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    default_ratio: float = 0.15
    policy: SelectionPolicy = field(default_factory=default_policy)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    kv_format: str = "fp16"
    # how a prefill's rows attend: "auto" (the C++ kernel on the CPU where it takes the cache, else
    # position-ordered SDPA blocks; one boolean-mask SDPA on a device), "blocks" (the SDPA blocks on the
    # CPU), "sdpa_mask" (the boolean mask everywhere), "flex" (FlexAttention, `executor.attention`)
    selected_attention: str = "auto"
    decode_attention: str = "auto"  # `executor.decode.decode_attention`: pooled / per_sequence / auto
    decode_graphs: str = "auto"  # "auto": pooled decode steps replayed as CUDA graphs on CUDA; "off": eager
    batch: BatchLimits = field(default_factory=BatchLimits)  # continuous batching (`scheduler.batch`)
    # automatic prefix caching over the KV pool: off, every request but prefix_cache mode's computes its
    # whole prompt (a benchmark comparing modes on one prompt must not let one mode take another's KV)
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        check_selected_attention(self.selected_attention)
        check_decode_attention(self.decode_attention)
        if self.decode_graphs not in ("auto", "off"):
            raise ValueError(f"decode_graphs must be auto or off, not {self.decode_graphs!r}")
        if not 0 <= self.default_ratio <= 1:
            raise ValueError("default_ratio must be within [0, 1]")


class BlendEngine:
    """Holds the model, the chunk cache and the engine loop; per-request state
    lives in `Generation`, the loop's request and `PrefillState`, never here."""

    def __init__(self, runner: ModelRunner, store: KVStore, config: EngineConfig | None = None,
                 loader: LayerLoader | None = None, controller: RatioController | None = None) -> None:
        self.runner = runner
        self.store = store
        self.config = config or EngineConfig()
        self.loader = loader or LayerLoader(store)
        self.controller = controller
        self.fingerprint = store_fingerprint(runner.fingerprint, self.config.kv_format)
        self.chunks = ChunkCache(runner, store, self.fingerprint)
        self.env = PlanEnv(store, controller, self.config.default_ratio, runner.shape.n_layers,
                           self.bytes_per_layer)
        self.loop = EngineLoop(self, self.config.batch, self.config.decode_attention, self.config.decode_graphs)
        self._close_lock = threading.Lock()

    # ================================================================== the chunk cache
    def layout(self, plan: BlendPlan) -> PromptLayout:
        system = plan.system_prompt if plan.system_prompt is not None else self.config.system_prompt
        return build_layout(self.runner.encode, self.runner.tokenizer, system, plan.passages, plan.question,
                            plan.turns, plan.numbered)

    def passage_tokens(self, passage: str) -> list[int]:
        return self.chunks.passage_tokens(passage)

    def key_of(self, token_ids: Sequence[int], salt: str | None = None) -> str:
        return self.chunks.key_of(token_ids, salt)

    def run_compute(self, fn: Callable[[], T], should_stop: StopCheck | None = None) -> T:
        """`fn()` on the engine loop between its steps (once the loop started): the thread that computes
        on every core (`cpu_threads`); ingestion's embedding batches go there too."""
        return self.loop.run_task(fn, should_stop)

    def precompute(self, token_ids: Sequence[int], should_stop: StopCheck | None = None) -> ChunkKV:
        """A chunk's alone-KV, computed on the engine loop between its steps (so ingestion never
        runs the model beside a batch). `should_stop`: not started once true, else stops between layers."""
        return self.loop.run_task(lambda: self.chunks.precompute(token_ids, should_stop), should_stop)

    def precompute_many(self, token_lists: Sequence[Sequence[int]], batch_size: int = 16,
                        should_stop: StopCheck | None = None) -> list[ChunkKV]:
        return self.loop.run_task(lambda: self.chunks.precompute_many(token_lists, batch_size, should_stop),
                                  should_stop)

    def cache_ids(self, token_ids: Sequence[int], salt: str | None = None,
                  should_stop: StopCheck | None = None) -> tuple[str, bool]:
        """Make sure the alone-KV of these chunk tokens is stored: (key, was already cached)."""
        return self.loop.run_task(lambda: self.chunks.cache_ids(token_ids, salt, should_stop), should_stop)

    def cache_many(self, token_lists: Sequence[Sequence[int]], batch_size: int = 16,
                   salt: str | None = None, should_stop: StopCheck | None = None) -> list[bool]:
        """`cache_ids` for many chunks, `batch_size` per forward: per chunk, whether stored now."""
        return self.loop.run_task(lambda: self.chunks.cache_many(token_lists, batch_size, salt, should_stop),
                                  should_stop)

    def ensure_cached(self, passage: str, should_stop: StopCheck | None = None) -> tuple[str, int, bool]:
        """Make sure a passage's KV is stored. Returns (key, n_tokens, was_already_cached)."""
        ids = self.passage_tokens(passage)
        key, cached = self.cache_ids(ids, should_stop=should_stop)
        return key, len(ids), cached

    def bytes_per_layer(self, n_tokens: int) -> int:
        s = self.runner.shape
        return layer_nbytes(self.config.kv_format, s.n_kv_heads, n_tokens, s.head_dim)

    # ================================================================== prefill (scheduler + executor)
    def prepare(self, plan: BlendPlan, max_new_tokens: int, layout: PromptLayout | None = None) -> Prepared:
        """Layout (unless the caller built it: one per request), keys, the mode plan and the
        prompt's block hash chains: host work only, on the caller's thread."""
        layout = layout if layout is not None else self.layout(plan)
        self.chunks.check_fits(layout.n_tokens, max_new_tokens)
        self.loop.check_fits(layout.n_tokens, max_new_tokens)
        policy = plan.policy or self.config.policy
        keys = tuple(self.key_of(s.token_ids, plan.cache_salt) if s.kind != "question" else None
                     for s in layout.segments)
        mp = plan_prefill(self.env, plan, layout, keys, policy)
        return Prepared(layout, keys, mp, policy, *self._prefix_chains(plan, layout, mp))

    def _prefix_chains(self, plan: BlendPlan, layout: PromptLayout, mp) -> tuple[tuple[tuple[str, ...], ...],
                                                                                tuple[str, ...], int]:
        """(the chains it may take a cached prefix from, its own chain, the shortest prefix worth
        taking): automatic prefix caching's view of this request (`scheduler.kv_blocks`)."""
        bt = self.config.batch.block_tokens
        take, own = recipes(mp.mode)
        ids = layout.token_ids()
        chains = {r: chain_hashes(chain_root(self.fingerprint, plan.cache_salt, r), ids, bt) for r in {*take, own}}
        context_end = next((s.offset for s in layout.segments if s.kind in ("turn", "question")), layout.n_tokens)
        floor = min_prefix(mp.mode, context_end, bt)
        apc = self.config.prefix_caching or mp.mode is Mode.PREFIX_CACHE  # that mode is the pool's prefix cache
        if plan.explain or not apc:  # explain shows the check layer's scores
            floor = NO_PREFIX
        return tuple(chains[r] for r in take), chains[own], floor

    def start_run(self, plan: BlendPlan, prep: Prepared, max_new_tokens: int, hooks: LayerHooks = SERVING,
                  cache: KVCache | None = None) -> PrefillRun:
        """The prefill's tensors; into `cache` (a run of the engine loop's pool) when given."""
        return PrefillRun(self.runner, self.loader, plan, prep.layout, prep.mp, prep.policy, max_new_tokens,
                          self.config.selected_attention, self.chunks.precompute, hooks, cache)

    def complete_run(self, plan: BlendPlan, prep: Prepared, run: PrefillRun) -> PrefillState:
        state = run.finish()
        if self.controller is not None and prep.mp.learns:
            self.controller.observe(state.report, self.bytes_per_layer(prep.mp.cached_tokens), compute=not run.shared)
        return state

    # ================================================================== generation (the engine loop)
    def generate(self, plan: BlendPlan, gen: GenerationConfig | None = None) -> Generation:
        """A handle: iterating it submits the request to the engine loop, where it is batched."""
        return Generation(self._submit, plan, gen or GenerationConfig())

    def start(self, plan: BlendPlan, gens: Sequence[GenerationConfig], sink: Callable[[int, object], None],
              should_stop: StopCheck = never, timeout_s: float | None = None,
              layout: PromptLayout | None = None, ticket: Ticket | None = None,
              export: Callable[[KVCache, PrefillState], None] | None = None,
              prep: Prepared | None = None) -> list[Generation]:
        """The n sequences of one request (one per `GenerationConfig`), laid out (unless `layout` is
        given) and planned once and submitted together; sequence i's items go to `sink(i, item)`
        from the engine loop's thread (`generation.Generation`). They stop at the next step once
        `should_stop()` is true or `timeout_s` has passed. Input errors (context overflow, a prompt
        the KV pool cannot hold) and admission's refusal (`errors.Overloaded`) raise here, before
        any is queued; a `ticket` taken earlier (`scheduler.admission`) is used, and stays its
        taker's to release when this raises (`Ticket.release` is a no-op once used). `export(cache,
        state)` is called on the loop's thread once the prefill is done (`Generation.export`); `prep`,
        this plan's `prepare` made earlier (on a worker thread), is taken as it is."""
        prep = prep if prep is not None else self.prepare(plan, max(g.max_tokens for g in gens), layout)
        handles = [Generation(None, plan, g, sink=functools.partial(sink, i)) for i, g in enumerate(gens)]
        handles[0].export = export  # `Generation.export`: the first sequence's KV, once prefilled
        self.loop.submit(handles, prep, should_stop, timeout_s, ticket)
        return handles

    def _submit(self, handle: Generation) -> None:
        self.loop.submit([handle], self.prepare(handle.plan, handle.gen.max_tokens))

    def run(self, plan: BlendPlan, gen: GenerationConfig | None = None) -> BlendResult:
        g = self.generate(plan, gen)
        for _ in g:
            pass
        return g.result

    # ================================================================== the research and test seam
    # Outside the engine loop and its KV pool, on the calling thread: one prefill whole (its layer
    # hooks overridable: `benchmarks/quality/oracle_seam.py`), one decode step over a cache of its own.
    # Tests, benchmarks and the GPU check compare the modes and kernels with these; nothing that serves
    # calls them (tests/test_import_rules.py holds it); they compute on the caller's thread, so only while
    # the loop is idle.
    @torch.inference_mode()
    def prefill(self, plan: BlendPlan, max_new_tokens: int = 0, hooks: LayerHooks = SERVING) -> PrefillState:
        """One prefill, whole, on the calling thread (benchmarks, tests), outside the KV pool (so it
        takes no cached prefix). `hooks`: a research run's seam (`executor.layers.LayerHooks`,
        overridden in benchmarks/)."""
        prep = self.prepare(plan, max_new_tokens)
        run = self.start_run(plan, prep, max_new_tokens, hooks)
        for _ in run.steps():
            pass
        return self.complete_run(plan, prep, run)

    @torch.inference_mode()
    def decode_step(self, cache: KVCache, token_id: int, input_pos: int | None = None) -> torch.Tensor:
        """Append one token at `input_pos` (default: cache.length); logits [V] for the next one."""
        pos = cache.length if input_pos is None else input_pos
        return decode_batch(self.runner, [cache], [token_id], [pos])[0]  # [V]

    def close(self) -> None:
        """Stop the engine loop (queued and running requests fail with Cancelled). Safe to call twice."""
        with self._close_lock:
            self.loop.close()
