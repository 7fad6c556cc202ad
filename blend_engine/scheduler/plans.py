"""A plan per mode: what one prefill loads from a cache and what it recomputes. Torch-free:
positions are integer spans; the executor turns them into tensors.

    | sys | chunk_1 .. chunk_k | question |

    full_prefill  nothing loaded             every token recomputed, causal
    prefix_cache  nothing loaded; the KV pool's longest cached exact prefix   the rest
    full_reuse    every cached chunk, moved by RoPE     only uncached tokens
    blend         every cached chunk, moved by RoPE     all tokens up to the check layer, then the
                                                        selected ones (`budget.kept` of them)

A blend request may be served by full prefill when the ratio controller finds loading slower
than recomputing (`RatioSource.FULL_PREFILL`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from blend_engine.layout import PromptLayout, Segment
from blend_engine.scheduler.budget import PrefillWork
from blend_engine.types import BlendPlan, Mode, SelectionPolicy

if TYPE_CHECKING:
    from blend_engine.kv_store.base import KVStore
    from blend_engine.scheduler.controller import RatioChoice

Span = tuple[int, int]  # [start, end) prompt positions


class RatioSource(str, Enum):
    """Where a prefill's ratio came from (`BlendReport.ratio_source` carries its value)."""

    MODE = "mode"  # fixed by the mode: 1.0 full prefill, 0.0 full reuse / prefix cache
    REQUEST = "request"
    DEFAULT = "default"
    CONTROLLER = "controller"
    FULL_PREFILL = "controller:full_prefill"  # a blend request the controller served by full prefill


class RatioController(Protocol):
    """Chooses a recompute ratio per request from measured load and compute speeds, or full prefill
    when loading the cache would be slower than recomputing it (`controller.BandwidthController`)."""

    def choose(self, work: PrefillWork, store: KVStore) -> RatioChoice: ...

    def observe(self, report: Any, bytes_per_layer: int) -> None: ...


@dataclass(frozen=True)
class PlanEnv:
    """What planning reads: the chunk store, the controller and model numbers."""

    store: KVStore
    controller: RatioController | None
    default_ratio: float
    n_layers: int
    bytes_per_layer: Callable[[int], int]  # loaded tokens -> bytes per layer


@dataclass(frozen=True)
class ModePlan:
    """What runs (blend may become full_prefill), what is loaded, what is recomputed."""

    mode: Mode
    ratio: float
    source: RatioSource
    store: KVStore  # where `cached` is read from
    cached: tuple[tuple[Segment, str], ...] = ()  # loaded segments with their key in `store`
    recompute: tuple[Span, ...] | None = None  # positions recomputed at every layer; None: see check_layer
    check_layer: int | None = None  # blend: every token up to here, then the selected ones
    hits: int = 0
    misses: int = 0
    prefix_tokens: int = 0
    missing: tuple[int, ...] = ()  # segment indices whose alone-KV should be stored after answering

    @property
    def cached_tokens(self) -> int:
        return sum(len(s.token_ids) for s, _ in self.cached)

    @property
    def learns(self) -> bool:
        """Whether the controller learns from this prefill (a blend that loaded, or its fallback)."""
        return (self.mode is Mode.BLEND and bool(self.cached)) or self.source is RatioSource.FULL_PREFILL


def plan_prefill(env: PlanEnv, plan: BlendPlan, layout: PromptLayout, keys: Sequence[str | None],
                 policy: SelectionPolicy) -> ModePlan:
    """The plan of one request; `keys[i]` is segment i's chunk key (None: never cached, the question)."""
    ratio, source = choose_ratio(env, plan)
    if plan.mode is Mode.FULL_PREFILL:  # nothing loaded; the passages the store lacks are stored after it
        return ModePlan(Mode.FULL_PREFILL, ratio, source, env.store, missing=_lacking(env, keys))
    if plan.mode is Mode.PREFIX_CACHE:  # vLLM's way: what the KV pool's prefix cache holds (`continue_prefix`)
        return ModePlan(Mode.PREFIX_CACHE, ratio, source, env.store, recompute=((0, layout.n_tokens),))
    return _chunk_plan(env, plan.mode, layout, keys, policy, ratio, source)


def _lacking(env: PlanEnv, keys: Sequence[str | None]) -> tuple[int, ...]:
    """Segment indices whose chunk the store does not hold (never the question's: key None)."""
    return tuple(i for i, k in enumerate(keys) if k is not None and not env.store.contains(k))


def continue_prefix(mp: ModePlan, prefix_tokens: int, n_tokens: int) -> ModePlan:
    """The plan once an automatic prefix cache hit put positions [0, prefix_tokens) in the request's
    KV as is: only the rest is computed, exactly, over it; nothing is loaded.

        | cached prefix (no load, no recompute)   | rest: recomputed at every layer |
          0                                        prefix_tokens                     n_tokens
    """
    return ModePlan(mp.mode, mp.ratio, mp.source, mp.store, recompute=((prefix_tokens, n_tokens),), hits=mp.hits,
                    misses=mp.misses, prefix_tokens=prefix_tokens, missing=mp.missing)


def choose_ratio(env: PlanEnv, plan: BlendPlan) -> tuple[float | None, RatioSource]:
    """(ratio, source); None with source CONTROLLER when the controller decides after lookups."""
    if plan.mode is Mode.FULL_PREFILL:
        return 1.0, RatioSource.MODE
    if plan.mode in (Mode.FULL_REUSE, Mode.PREFIX_CACHE):
        return 0.0, RatioSource.MODE
    if plan.recompute_ratio is not None:
        return plan.recompute_ratio, RatioSource.REQUEST
    if env.controller is not None:
        return None, RatioSource.CONTROLLER
    return env.default_ratio, RatioSource.DEFAULT


def _chunk_plan(env: PlanEnv, mode: Mode, layout: PromptLayout, keys: Sequence[str | None],
                policy: SelectionPolicy, ratio: float | None, source: RatioSource) -> ModePlan:
    """full_reuse and blend: every chunk found in the chunk store is loaded."""
    segs = layout.segments
    missing = _lacking(env, keys)
    cached = [(s, k) for i, (s, k) in enumerate(zip(segs, keys)) if k is not None and i not in missing]
    hits, misses = len(cached), len(missing)
    if mode is Mode.FULL_REUSE:
        uncached = tuple((s.offset, s.end) for i, s in enumerate(segs) if keys[i] is None or i in missing)
        return ModePlan(mode, ratio, source, env.store, tuple(cached), uncached, hits=hits, misses=misses,
                        missing=missing)
    if ratio is None:  # the controller decides now that hits and misses are known
        choice = env.controller.choose(prefill_work(env, layout, cached, policy), env.store)
        ratio = choice.ratio
        if choice.full_prefill:  # loading would be slower than recomputing everything
            return ModePlan(Mode.FULL_PREFILL, 1.0, RatioSource.FULL_PREFILL, env.store, misses=misses,
                            missing=missing)
    return ModePlan(mode, ratio, source, env.store, tuple(cached), check_layer=policy.check_layer,
                    hits=hits, misses=misses, missing=missing)


def competing(seg: Segment, cached: bool) -> bool:
    """Whether a segment's tokens compete for recompute: a cached chunk other than the system
    prefix (exact: cached alone at position 0, never redone)."""
    return cached and seg.kind not in ("sys", "question")


def sink_count(seg: Segment, sink_tokens: int) -> int:
    """EPIC sinks: the first `sink_tokens` tokens of a competing chunk are always recomputed."""
    return min(sink_tokens, len(seg.token_ids))


def end_count(seg: Segment, sink_tokens: int, end_tokens: int) -> int:
    """EPIC's end boundary: the last `end_tokens` tokens of a competing chunk are always recomputed,
    those that are not already sinks."""
    return min(end_tokens, len(seg.token_ids) - sink_count(seg, sink_tokens))


def prefill_work(env: PlanEnv, layout: PromptLayout, cached: Sequence[tuple[Segment, str]],
                 policy: SelectionPolicy) -> PrefillWork:
    """What a blend prefill of this layout costs: chunks that missed the cache are uncached work."""
    chunks = [s for s, _ in cached if competing(s, True)]
    sinks = sum(sink_count(s, policy.sink_tokens) + end_count(s, policy.sink_tokens, policy.end_tokens) for s in chunks)
    n_loaded = sum(len(s.token_ids) for s, _ in cached)
    n_compete = sum(len(s.token_ids) for s in chunks) - sinks
    return PrefillWork(n_tokens=layout.n_tokens, n_cached=n_compete, n_forced=layout.n_tokens - n_loaded + sinks,
                       n_layers=env.n_layers, bytes_per_layer=env.bytes_per_layer(n_loaded), policy=policy)
