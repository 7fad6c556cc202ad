"""The blend engine: assemble cached passages, repair them selectively, generate.

Token layout of every prompt::

    | sys | passage_1 .. passage_k | question |
      ^cached at 0   ^cached alone at 0..T-1, moved by RoPE   ^never cached

Modes (`plans`: what each loads and recomputes; all run through one layer loop, `layers`):
- full_prefill: every token recomputed at every layer (causal attention), nothing loaded.
- prefix_cache: reuse the longest run of leading segments whose *in-context* KV was cached by an
  earlier prefix_cache request with exactly that prefix (vLLM/SGLang style, `prefix_cache`),
  prefill the rest.
- full_reuse: concatenate cached chunks (`placement`), recompute only uncached tokens.
- blend (CacheBlend, `selection`): recompute every token up to the check layer, pick the tokens
  whose fresh K/V deviate most from the cache there, recompute only those (plus uncached tokens)
  above it.
Generation (sampling and decoding) is in `generation`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from blend_engine.attention import check_selected_attention
from blend_engine.errors import InputError
from blend_engine.explain import Explanation, ScoreProbe, build_explanation, tier_of
from blend_engine.generation import Generation
from blend_engine.keys import chunk_key, store_fingerprint
from blend_engine.kv_store import ChunkKV, KVStore
from blend_engine.kv_store.codec import layer_nbytes
from blend_engine.kv_store.controller import PrefillWork, RatioChoice
from blend_engine.kv_store.loader import LayerLoader, LoadTrace
from blend_engine.layers import KVCache, LayerJob, LayerOutput, Timer, run_layers
from blend_engine.layout import DEFAULT_SYSTEM_PROMPT, PromptLayout, Segment, build_layout, passage_text
from blend_engine.model import ModelRunner
from blend_engine.plans import FULL_PREFILL_SOURCE, ModePlan, plan_prefill
from blend_engine.prefix_cache import PrefixCache
from blend_engine.selection import RankSpace as _RankSpace  # noqa: F401 - importable from here, as before
from blend_engine.transfer import LayerPacker
from blend_engine.types import (
    BlendPlan,
    BlendReport,
    BlendResult,
    GenerationConfig,
    Mode,
    SelectionPolicy,
    default_policy,
)

__all__ = ["FULL_PREFILL_SOURCE", "BlendEngine", "EngineConfig", "Generation", "KVCache", "PrefillState",
           "RatioController"]

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class RatioController(Protocol):
    """Chooses a recompute ratio per request from measured load and compute speeds, or full prefill
    when loading the cache would be slower than recomputing it (`kv_store.controller`)."""

    def choose(self, work: PrefillWork, store: KVStore) -> RatioChoice: ...

    def observe(self, report: BlendReport, bytes_per_layer: int) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    default_ratio: float = 0.15
    policy: SelectionPolicy = field(default_factory=default_policy)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    kv_format: str = "fp16"
    prefix_cache_bytes: int = 1 << 30  # budget of the prefix_cache mode's in-context entries
    # how a blend's selected rows attend: "auto" (4 blocks on the CPU, one boolean-mask SDPA on a
    # device), "sdpa_mask" (the boolean mask everywhere), "flex" (FlexAttention, `attention`)
    selected_attention: str = "auto"

    def __post_init__(self) -> None:
        check_selected_attention(self.selected_attention)
        if not 0 <= self.default_ratio <= 1:
            raise ValueError("default_ratio must be within [0, 1]")
        if self.prefix_cache_bytes < 0:
            raise ValueError("prefix_cache_bytes must be >= 0")


@dataclass
class PrefillState:
    """The outcome of a prefill: cache, last-position logits [V], report. Per request only."""

    cache: KVCache
    logits: torch.Tensor
    report: BlendReport
    layout: PromptLayout
    missing: list[int]  # segment indices whose alone-KV should be stored after answering
    explanation: Explanation | None = None  # only when the plan asked for it


class BlendEngine:
    """Per request all state lives in locals and `PrefillState`. The engine holds the model, the
    chunk store, and the prefix cache of prefix_cache mode (`prefix_cache`, its own budget)."""

    def __init__(
        self,
        runner: ModelRunner,
        store: KVStore,
        config: EngineConfig | None = None,
        loader: LayerLoader | None = None,
        controller: RatioController | None = None,
    ) -> None:
        self.runner = runner
        self.store = store
        self.config = config or EngineConfig()
        self.loader = loader or LayerLoader(store)
        self.controller = controller
        self.fingerprint = store_fingerprint(runner.fingerprint, self.config.kv_format)
        exact = _DTYPE_NAMES.get(runner.dtype, "fp32")
        self.prefix_cache = PrefixCache(self.config.prefix_cache_bytes, exact, store)
        self._sampler_lock = threading.Lock()

    # ================================================================== keys and precompute
    def layout(self, plan: BlendPlan) -> PromptLayout:
        system = plan.system_prompt if plan.system_prompt is not None else self.config.system_prompt
        return build_layout(self.runner.encode, self.runner.tokenizer, system, plan.passages, plan.question)

    def passage_tokens(self, passage: str) -> list[int]:
        """Token ids of a passage exactly as it is cached and placed in prompts."""
        return self.runner.encode(passage_text(passage))

    def key_of(self, token_ids) -> str:
        return chunk_key(self.fingerprint, token_ids)

    @torch.inference_mode()
    def precompute(self, token_ids) -> ChunkKV:
        """Prefill a chunk alone at positions 0..T-1; every layer's K (after RoPE) and V."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.runner.device)  # [T]
        self._check_fits(len(ids), 0)
        return run_layers(self.runner, LayerJob(ids)).cache.segment(0, len(ids))

    @torch.inference_mode()
    def precompute_many(self, token_lists, batch_size: int = 16) -> list[ChunkKV]:
        """`precompute` for many chunks, batched on the device: chunks of similar length are
        right-padded into one forward of the model (each alone at positions 0..T-1: a causal
        model's real tokens never see the padding after them). Results in input order."""
        lists = [list(t) for t in token_lists]
        order = sorted(range(len(lists)), key=lambda i: len(lists[i]))
        out: list[ChunkKV | None] = [None] * len(lists)
        for start in range(0, len(order), batch_size):
            group = order[start:start + batch_size]
            longest = len(lists[group[-1]])
            self._check_fits(longest, 0)
            ids = torch.zeros((len(group), longest), dtype=torch.long)  # [B, T]
            mask = torch.zeros((len(group), longest), dtype=torch.long)  # [B, T]
            for row, i in enumerate(group):
                ids[row, :len(lists[i])] = torch.tensor(lists[i])
                mask[row, :len(lists[i])] = 1
            dev = self.runner.device
            layers = self.runner.prefill_cache(ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True))
            for row, i in enumerate(group):
                t = len(lists[i])
                out[i] = ChunkKV(torch.stack([k[row, :, :t] for k, _ in layers]),  # [L, H, T, D]
                                 torch.stack([v[row, :, :t] for _, v in layers]))  # [L, H, T, D]
        return out  # type: ignore[return-value]

    def cache_ids(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Make sure the alone-KV of these chunk tokens is stored: (key, was already cached)."""
        key = self.key_of(token_ids)
        if self.store.contains(key):
            return key, True
        self.store.put(key, self.precompute(token_ids))
        return key, False

    def ensure_cached(self, passage: str) -> tuple[str, int, bool]:
        """Make sure a passage's KV is stored. Returns (key, n_tokens, was_already_cached)."""
        ids = self.passage_tokens(passage)
        key, cached = self.cache_ids(ids)
        return key, len(ids), cached

    # ================================================================== prefill
    def _check_fits(self, n_tokens: int, extra: int) -> None:
        limit = self.runner.shape.max_positions
        if n_tokens + extra > limit:
            raise InputError(
                f"prompt of {n_tokens} tokens plus {extra} new tokens exceeds the model context of {limit}"
            )

    def bytes_per_layer(self, n_tokens: int) -> int:
        s = self.runner.shape
        return layer_nbytes(self.config.kv_format, s.n_kv_heads, n_tokens, s.head_dim)

    @torch.inference_mode()
    def prefill(self, plan: BlendPlan, max_new_tokens: int = 0) -> PrefillState:
        t_start = time.perf_counter()
        layout = self.layout(plan)
        self._check_fits(layout.n_tokens, max_new_tokens)
        policy = plan.policy or self.config.policy
        ids = torch.tensor(layout.token_ids(), dtype=torch.long, device=self.runner.device)  # [N]
        keys = [self.key_of(s.token_ids) if s.kind != "question" else None for s in layout.segments]
        mp = plan_prefill(self, plan, layout, keys, policy)
        probe = ScoreProbe() if plan.explain else None
        tiers = {k: tier_of(mp.store, k) for _, k in mp.cached} if plan.explain else {}  # before loading promotes
        stream = self._stream(mp)
        job = LayerJob(ids, max_new_tokens, tuple(s for s, _ in mp.cached), stream, mp.recompute, mp.check_layer,
                       mp.ratio, policy, layout, rotate=not mp.in_context, probe=probe,
                       attention=self.config.selected_attention)
        try:
            out = run_layers(self.runner, job)
        finally:
            if stream is not None:
                stream.close()
        final = self._final_positions(out, layout.n_tokens)
        layer_times = out.clock.seconds()
        logits = self.runner.logits(out.last_hidden)[0]  # [V]
        if plan.mode is Mode.PREFIX_CACHE:
            self.prefix_cache.save(layout.segments, keys, out.cache)
        trace = stream.trace if stream is not None else LoadTrace()
        report = _report(mp, layout, out, final, layer_times, trace, job.timer, t_start)
        if self.controller is not None and ((mp.mode is Mode.BLEND and mp.cached) or mp.source == FULL_PREFILL_SOURCE):
            self.controller.observe(report, self.bytes_per_layer(mp.cached_tokens))
        explanation = None
        if probe is not None:
            explanation = self._explain(plan, layout, final, probe, mp, tiers, trace, policy)
        return PrefillState(out.cache, logits, report, layout, list(mp.missing), explanation)

    @staticmethod
    def _final_positions(out: LayerOutput, n: int) -> list[int]:
        final = list(range(n)) if out.selected is None else _to_host(out.selected)  # the request's one host sync
        if final[-1] != n - 1:
            raise AssertionError("the last prompt position must always be recomputed")
        return final

    def _stream(self, mp: ModePlan):
        """The layer stream of the plan's cached chunks, packed for the device (None: nothing cached)."""
        if not mp.cached:
            return None
        repair = self._repairer({k: s for s, k in mp.cached}, mp.in_context)
        loader = self.loader if mp.store is self.store else LayerLoader(mp.store)
        packer = LayerPacker(self.runner.device, self.runner.dtype, slots=loader.prefetch_depth + 2)
        return loader.stream([k for _, k in mp.cached], self.runner.shape.n_layers, repair, packer,
                             stored=packer.moves_int8)  # int8 moves as int8, dequantized on the device

    @staticmethod
    def _explain(plan: BlendPlan, layout: PromptLayout, final: list[int], probe: ScoreProbe, mp: ModePlan,
                 tiers: dict[str, str | None], trace: LoadTrace, policy: SelectionPolicy) -> Explanation:
        """Per segment: recomputed flags, check-layer scores (one host copy), cache status and tier."""
        loaded = {s.offset: k for s, k in mp.cached if k not in trace.repaired}
        status: list[tuple[str, str | None]] = []
        for seg in layout.segments:
            if seg.kind == "question" or plan.mode is Mode.FULL_PREFILL:
                status.append(("off", None))
            elif seg.offset in loaded:
                status.append(("hit", tiers.get(loaded[seg.offset])))
            else:
                status.append(("miss", None))
        metric = "none"
        if mp.check_layer is not None and policy.use_deviation:
            metric = f"{policy.metric} deviation" + (" x question attention" if policy.query_weighted else "")
        return build_explanation(layout, final, probe.to_host(), status, mp.check_layer, metric)

    def _repairer(self, seg_of_key: dict[str, Segment], in_context: bool):
        def repair(key: str) -> ChunkKV:
            if in_context:  # a prefix entry vanished mid-stream: cannot rebuild it alone
                raise RuntimeError(f"prefix cache entry {key} vanished while loading")
            logger.warning("chunk %s missing or corrupt; recomputing from its tokens", key)
            return self.precompute(seg_of_key[key].token_ids)

        return repair

    # ================================================================== generation
    def generate(self, plan: BlendPlan, gen: GenerationConfig | None = None) -> Generation:
        return Generation(self, plan, gen or GenerationConfig())

    def run(self, plan: BlendPlan, gen: GenerationConfig | None = None) -> BlendResult:
        g = self.generate(plan, gen)
        for _ in g:
            pass
        return g.result

    @torch.inference_mode()
    def decode_step(self, cache: KVCache, token_id: int) -> torch.Tensor:
        """Append one token at position cache.length; logits [V] for the next one."""
        r = self.runner
        p = cache.length
        if p >= cache.capacity:
            raise ValueError("KV cache capacity exhausted")
        hidden = r.embed(torch.tensor([token_id], device=r.device))  # [1, E]
        cos, sin = r.rope(torch.tensor([p]))  # [1, D] each
        windows = r.window_masks(torch.tensor([p]), p + 1)  # layer -> [1, p+1] or None (full attention)
        for layer in range(r.shape.n_layers):
            q, k, v = r.qkv(layer, hidden, cos, sin)  # [Hq, 1, D], [H, 1, D], [H, 1, D]
            cache.k[layer][:, p:p + 1] = k
            cache.v[layer][:, p:p + 1] = v
            out = r.attend(q, cache.k[layer][:, :p + 1], cache.v[layer][:, :p + 1], windows(layer))  # [1, Hq*D]
            hidden = r.finish_layer(layer, hidden, out)  # [1, E]
        cache.length = p + 1
        return r.logits(hidden)[0]  # [V]

    def store_missing(self, state: PrefillState) -> int:
        """After answering: store the alone-KV of passages that missed the cache."""
        stored = 0
        for i in state.missing:
            seg = state.layout.segments[i]
            key = self.key_of(seg.token_ids)
            if not self.store.contains(key) and self.store.put(key, self.precompute(seg.token_ids)):
                stored += 1
        return stored


def _report(mp: ModePlan, layout: PromptLayout, out: LayerOutput, final: list[int], layer_times: list[float],
            trace: LoadTrace, timer: Timer, t_start: float) -> BlendReport:
    return BlendReport(
        mode=mp.mode.value,
        recompute_ratio=mp.ratio,
        ratio_source=mp.source,
        context_tokens=layout.n_tokens,
        recomputed_tokens=len(final),
        recomputed_positions=tuple(final),
        selected_per_layer=out.sizes,
        cache_hits=mp.hits - len(trace.repaired),  # a chunk found corrupt while loading was recomputed
        cache_misses=mp.misses + len(trace.repaired),
        prefix_tokens_reused=mp.prefix_tokens,
        repaired_chunks=len(trace.repaired),
        assemble_ms=timer.assemble * 1e3,
        recompute_ms=sum(layer_times) * 1e3,  # device time on CUDA (events), wall time elsewhere
        load_ms=sum(trace.read_s) * 1e3,
        load_wait_ms=timer.wait * 1e3,
        prefill_ms=(time.perf_counter() - t_start) * 1e3,
        layer_load_ms=tuple(x * 1e3 for x in trace.read_s),
        layer_compute_ms=tuple(x * 1e3 for x in layer_times),
    )


def _to_host(t: torch.Tensor) -> list[int]:
    """THE device->host sync of a prefill: the final recomputed positions, once, after the layer
    loop (the report needs them). Nothing inside the loop reads a device value on the host."""
    return t.tolist()
