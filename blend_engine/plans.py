"""A plan per mode: what one prefill loads from a cache and what it recomputes.

    | sys | chunk_1 .. chunk_k | question |

    full_prefill  nothing loaded             every token recomputed, causal
    prefix_cache  the longest cached leading run, in context (prefix cache)   the rest
    full_reuse    every cached chunk, moved by RoPE     only uncached tokens
    blend         every cached chunk, moved by RoPE     all tokens up to the check layer, then the
                                                        selected ones (`selection.RankSpace`)

A blend request may be served by full prefill when the ratio controller finds loading slower
than recomputing (`FULL_PREFILL_SOURCE`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blend_engine.kv_store import KVStore
from blend_engine.kv_store.controller import PrefillWork
from blend_engine.layout import PromptLayout, Segment
from blend_engine.types import BlendPlan, Mode, SelectionPolicy

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine

FULL_PREFILL_SOURCE = "controller:full_prefill"  # ratio_source of a blend request served by full prefill


@dataclass(frozen=True)
class ModePlan:
    """What runs (blend may become full_prefill), what is loaded, what is recomputed."""

    mode: Mode
    ratio: float
    source: str  # where the ratio came from: mode, request, default, controller, FULL_PREFILL_SOURCE
    store: KVStore  # where `cached` is read from
    cached: tuple[tuple[Segment, str], ...] = ()  # loaded segments with their key in `store`
    recompute: torch.Tensor | None = None  # [S] positions recomputed at every layer; None: see check_layer
    check_layer: int | None = None  # blend: every token up to here, then the selected ones
    in_context: bool = False  # prefix entries sit where computed: not moved by RoPE, not rebuildable alone
    hits: int = 0
    misses: int = 0
    prefix_tokens: int = 0
    missing: tuple[int, ...] = ()  # segment indices whose alone-KV should be stored after answering

    @property
    def cached_tokens(self) -> int:
        return sum(len(s.token_ids) for s, _ in self.cached)


def plan_prefill(engine: BlendEngine, plan: BlendPlan, layout: PromptLayout, keys: Sequence[str | None],
                 policy: SelectionPolicy) -> ModePlan:
    """The plan of one request; `keys[i]` is segment i's chunk key (None for the question)."""
    ratio, source = choose_ratio(plan, engine)
    if plan.mode is Mode.FULL_PREFILL:
        return ModePlan(Mode.FULL_PREFILL, ratio, source, engine.store)
    if plan.mode is Mode.PREFIX_CACHE:
        cached, prefix_tokens = engine.prefix_cache.match(layout.segments, keys)
        hits = len(cached)
        recompute = torch.arange(prefix_tokens, layout.n_tokens, device=engine.runner.device)  # [S]
        return ModePlan(Mode.PREFIX_CACHE, ratio, source, engine.prefix_cache.store, tuple(cached), recompute,
                        in_context=True, hits=hits, misses=sum(1 for k in keys if k is not None) - hits,
                        prefix_tokens=prefix_tokens)
    return _chunk_plan(engine, plan.mode, layout, keys, policy, ratio, source)


def choose_ratio(plan: BlendPlan, engine: BlendEngine) -> tuple[float | None, str]:
    """(ratio, source); None with source "controller" when the controller decides after lookups."""
    if plan.mode is Mode.FULL_PREFILL:
        return 1.0, "mode"
    if plan.mode in (Mode.FULL_REUSE, Mode.PREFIX_CACHE):
        return 0.0, "mode"
    if plan.recompute_ratio is not None:
        return plan.recompute_ratio, "request"
    if engine.controller is not None:
        return None, "controller"
    return engine.config.default_ratio, "default"


def _chunk_plan(engine: BlendEngine, mode: Mode, layout: PromptLayout, keys: Sequence[str | None],
                policy: SelectionPolicy, ratio: float | None, source: str) -> ModePlan:
    """full_reuse and blend: every chunk found in the chunk store is loaded."""
    segs = layout.segments
    cached = [(s, k) for s, k in zip(segs, keys) if k is not None and engine.store.contains(k)]
    found = {s.offset for s, _ in cached}
    missing = tuple(i for i, (s, k) in enumerate(zip(segs, keys)) if k is not None and s.offset not in found)
    hits, misses = len(cached), len(missing)
    if mode is Mode.FULL_REUSE:
        uncached = [torch.arange(s.offset, s.end) for i, s in enumerate(segs) if keys[i] is None or i in missing]
        recompute = torch.cat(uncached).to(engine.runner.device, non_blocking=True)  # [S]
        return ModePlan(mode, ratio, source, engine.store, tuple(cached), recompute, hits=hits, misses=misses,
                        missing=missing)
    if ratio is None:  # the controller decides now that hits and misses are known
        choice = engine.controller.choose(prefill_work(engine, layout, cached, policy), engine.store)
        ratio = choice.ratio
        if choice.full_prefill:  # loading would be slower than recomputing everything
            return ModePlan(Mode.FULL_PREFILL, 1.0, FULL_PREFILL_SOURCE, engine.store, misses=misses, missing=missing)
    return ModePlan(mode, ratio, source, engine.store, tuple(cached), check_layer=policy.check_layer,
                    hits=hits, misses=misses, missing=missing)


def prefill_work(engine: BlendEngine, layout: PromptLayout, cached: list[tuple[Segment, str]],
                 policy: SelectionPolicy) -> PrefillWork:
    """What a blend prefill of this layout costs: passages that missed the cache are uncached work."""
    passages = [s for s, _ in cached if s.kind == "passage"]
    sinks = sum(min(policy.sink_tokens, len(s.token_ids)) for s in passages)
    n_loaded = sum(len(s.token_ids) for s, _ in cached)
    n_compete = sum(len(s.token_ids) for s in passages) - sinks
    return PrefillWork(n_tokens=layout.n_tokens, n_cached=n_compete, n_forced=layout.n_tokens - n_loaded + sinks,
                       n_layers=engine.runner.shape.n_layers, bytes_per_layer=engine.bytes_per_layer(n_loaded),
                       check_layer=policy.check_layer, check_multiplier=policy.check_multiplier,
                       schedule=policy.schedule)
