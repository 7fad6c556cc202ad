"""The blend engine: assemble cached passages, repair them selectively, generate.

Token layout of every prompt::

    | sys | passage_1 .. passage_k | question |
      ^cached at 0   ^cached alone at 0..T-1, moved by RoPE   ^never cached

Modes (all run through the same layer loop, `_run_layers`):
- full_prefill: every token recomputed at every layer (causal attention), nothing loaded.
- prefix_cache: reuse the longest run of leading segments whose *in-context* KV was cached by an
  earlier prefix_cache request with exactly that prefix (vLLM/SGLang style), prefill the rest.
- full_reuse: concatenate cached chunks, recompute only uncached tokens.
- blend (CacheBlend): recompute every token up to the check layer, pick the tokens whose fresh
  K/V deviate most from the cache there, recompute only those (plus uncached tokens) above it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from blend_engine.cancel import checkpoint
from blend_engine.errors import InputError
from blend_engine.explain import Explanation, ScoreProbe, build_explanation, tier_of
from blend_engine.keys import chain_key, chunk_key, store_fingerprint
from blend_engine.kv_store import ChunkKV, KVStore, MemoryStore
from blend_engine.kv_store.codec import layer_nbytes
from blend_engine.kv_store.controller import PrefillWork, RatioChoice
from blend_engine.kv_store.loader import LayerLoader, LoadTrace
from blend_engine.layout import DEFAULT_SYSTEM_PROMPT, PromptLayout, Segment, build_layout, passage_text
from blend_engine.model import ModelRunner
from blend_engine.sampling import Sampler, StreamDecoder
from blend_engine.transfer import LayerPacker, PackedLayer, cuda_ready
from blend_engine.types import (
    BlendPlan,
    BlendReport,
    BlendResult,
    GenerationConfig,
    Mode,
    SelectionPolicy,
    default_policy,
)

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


FULL_PREFILL_SOURCE = "controller:full_prefill"  # ratio_source of a blend request served by full prefill


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
    prefix_cache_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not 0 <= self.default_ratio <= 1:
            raise ValueError("default_ratio must be within [0, 1]")


class KVCache:
    """Per-request blended cache. k[l], v[l]: [H, capacity, D]; positions 0..length-1 are valid."""

    def __init__(self, n_layers: int, n_kv_heads: int, capacity: int, head_dim: int, dtype, device) -> None:
        shape = (n_kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]  # L x [H, C, D]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(n_layers)]  # L x [H, C, D]
        self.length = 0
        self.capacity = capacity

    def segment(self, start: int, end: int) -> ChunkKV:
        k = torch.stack([kl[:, start:end] for kl in self.k])  # [L, H, T, D]
        v = torch.stack([vl[:, start:end] for vl in self.v])  # [L, H, T, D]
        return ChunkKV(k, v)


@dataclass
class PrefillState:
    """The outcome of a prefill: cache, last-position logits [V], report. Per request only."""

    cache: KVCache
    logits: torch.Tensor
    report: BlendReport
    layout: PromptLayout
    missing: list[int]  # segment indices whose alone-KV should be stored after answering
    explanation: Explanation | None = None  # only when the plan asked for it


@dataclass
class _Timer:
    assemble: float = 0.0
    compute: float = 0.0
    wait: float = 0.0


class BlendEngine:
    """Stateless per request: all request state lives in locals and `PrefillState`."""

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
        self.prefix_store = MemoryStore(self.config.prefix_cache_bytes, kv_format=exact, name="prefix")
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
        cache, _, _ = self._run_layers(ids, [], None, None, 0, 0.0, _Timer())
        return cache.segment(0, len(ids))

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

    def ensure_cached(self, passage: str) -> tuple[str, int, bool]:
        """Make sure a passage's KV is stored. Returns (key, n_tokens, was_already_cached)."""
        ids = self.passage_tokens(passage)
        key = self.key_of(ids)
        if self.store.contains(key):
            return key, len(ids), True
        self.store.put(key, self.precompute(ids))
        return key, len(ids), False

    # ================================================================== prefill
    def _check_fits(self, n_tokens: int, extra: int) -> None:
        limit = self.runner.shape.max_positions
        if n_tokens + extra > limit:
            raise InputError(
                f"prompt of {n_tokens} tokens plus {extra} new tokens exceeds the model context of {limit}"
            )

    def _choose_ratio(self, plan: BlendPlan) -> tuple[float | None, str]:
        """(ratio, source); None with source "controller" when the controller decides after lookups."""
        if plan.mode is Mode.FULL_PREFILL:
            return 1.0, "mode"
        if plan.mode in (Mode.FULL_REUSE, Mode.PREFIX_CACHE):
            return 0.0, "mode"
        if plan.recompute_ratio is not None:
            return plan.recompute_ratio, "request"
        if self.controller is not None:
            return None, "controller"
        return self.config.default_ratio, "default"

    def _work(self, layout: PromptLayout, cached: list[tuple[Segment, str]], policy: SelectionPolicy) -> PrefillWork:
        """What a blend prefill of this layout costs: passages that missed the cache are uncached work."""
        passages = [s for s, _ in cached if s.kind == "passage"]
        sinks = sum(min(policy.sink_tokens, len(s.token_ids)) for s in passages)
        n_loaded = sum(len(s.token_ids) for s, _ in cached)
        n_compete = sum(len(s.token_ids) for s in passages) - sinks
        return PrefillWork(n_tokens=layout.n_tokens, n_cached=n_compete, n_forced=layout.n_tokens - n_loaded + sinks,
                           n_layers=self.runner.shape.n_layers, bytes_per_layer=self._bytes_per_layer(n_loaded),
                           check_layer=policy.check_layer, check_multiplier=policy.check_multiplier,
                           schedule=policy.schedule)

    def _bytes_per_layer(self, n_tokens: int) -> int:
        s = self.runner.shape
        return layer_nbytes(self.config.kv_format, s.n_kv_heads, n_tokens, s.head_dim)

    @torch.inference_mode()
    def prefill(self, plan: BlendPlan, max_new_tokens: int = 0) -> PrefillState:
        t_start = time.perf_counter()
        layout = self.layout(plan)
        self._check_fits(layout.n_tokens, max_new_tokens)
        ratio, source = self._choose_ratio(plan)
        mode = plan.mode  # what runs: blend may be served by full prefill when loading is too slow
        policy = plan.policy or self.config.policy
        ids = torch.tensor(layout.token_ids(), dtype=torch.long, device=self.runner.device)  # [N]
        segs = layout.segments
        keys = [self.key_of(s.token_ids) if s.kind != "question" else None for s in segs]
        timer = _Timer()
        hits = misses = prefix_tokens = 0
        missing: list[int] = []

        if plan.mode is Mode.FULL_PREFILL:
            cached: list[tuple[Segment, str]] = []
            sel0 = None
            stream_store: KVStore = self.store
        elif plan.mode is Mode.PREFIX_CACHE:
            cached, prefix_tokens = self._match_prefix(segs, keys)
            hits = len(cached)
            misses = sum(1 for k in keys if k is not None) - hits
            sel0 = torch.arange(prefix_tokens, layout.n_tokens, device=ids.device)  # [S]
            stream_store = self.prefix_store
        else:
            cached = []
            for i, (seg, key) in enumerate(zip(segs, keys)):
                if key is None:
                    continue
                if self.store.contains(key):
                    cached.append((seg, key))
                    hits += 1
                else:
                    missing.append(i)
                    misses += 1
            uncached = [torch.arange(s.offset, s.end) for i, s in enumerate(segs) if keys[i] is None or i in missing]
            sel0 = torch.cat(uncached).to(ids.device, non_blocking=True)  # [S]
            stream_store = self.store
            if ratio is None:  # the controller decides now that hits and misses are known
                choice = self.controller.choose(self._work(layout, cached, policy), self.store)
                ratio = choice.ratio
                if choice.full_prefill:  # loading would be slower than recomputing everything
                    mode, ratio, source, cached, sel0, hits = Mode.FULL_PREFILL, 1.0, FULL_PREFILL_SOURCE, [], None, 0
        full_upto = policy.check_layer if mode is Mode.BLEND else None
        probe = ScoreProbe() if plan.explain else None
        tiers = {k: tier_of(stream_store, k) for _, k in cached} if plan.explain else {}  # before loading promotes
        stream = None
        if cached:
            repair = self._repairer({k: s for s, k in cached}, plan.mode is Mode.PREFIX_CACHE)
            loader = self.loader if stream_store is self.store else LayerLoader(stream_store)
            packer = LayerPacker(self.runner.device, self.runner.dtype, slots=loader.prefetch_depth + 2)
            stream = loader.stream([k for _, k in cached], self.runner.shape.n_layers, repair, packer)
        try:
            cache, last_hidden, per_layer = self._run_layers(
                ids, [s for s, _ in cached], stream, sel0 if mode is not Mode.BLEND else None,
                max_new_tokens, ratio, timer, full_upto=full_upto, policy=policy, layout=layout,
                rotate=mode is not Mode.PREFIX_CACHE, probe=probe,
            )
        finally:
            if stream is not None:
                stream.close()
        logits = self.runner.logits(last_hidden)[0]  # [V]
        if plan.mode is Mode.PREFIX_CACHE:
            self._store_prefix(segs, keys, cache)
        trace = stream.trace if stream is not None else LoadTrace()
        final_sel, selected_per_layer, layer_compute = per_layer
        report = BlendReport(
            mode=mode.value,
            recompute_ratio=ratio,
            ratio_source=source,
            context_tokens=layout.n_tokens,
            recomputed_tokens=len(final_sel),
            recomputed_positions=tuple(final_sel),
            selected_per_layer=tuple(selected_per_layer),
            cache_hits=hits - len(trace.repaired),  # a chunk found corrupt while loading was recomputed
            cache_misses=misses + len(trace.repaired),
            prefix_tokens_reused=prefix_tokens,
            repaired_chunks=len(trace.repaired),
            assemble_ms=timer.assemble * 1e3,
            recompute_ms=sum(layer_compute) * 1e3,  # device time on CUDA (events), wall time elsewhere
            load_ms=sum(trace.read_s) * 1e3,
            load_wait_ms=timer.wait * 1e3,
            prefill_ms=(time.perf_counter() - t_start) * 1e3,
            layer_load_ms=tuple(x * 1e3 for x in trace.read_s),
            layer_compute_ms=tuple(x * 1e3 for x in layer_compute),
        )
        if self.controller is not None and ((mode is Mode.BLEND and cached) or source == FULL_PREFILL_SOURCE):
            self.controller.observe(report, self._bytes_per_layer(sum(len(s.token_ids) for s, _ in cached)))
        explanation = None
        if probe is not None:
            explanation = self._explain(plan, layout, final_sel, probe, cached, tiers, trace, full_upto, policy)
        return PrefillState(cache, logits, report, layout, missing, explanation)

    @staticmethod
    def _explain(plan: BlendPlan, layout: PromptLayout, final: list[int], probe: ScoreProbe,
                 cached: list[tuple[Segment, str]], tiers: dict[str, str | None], trace: LoadTrace,
                 check_layer: int | None, policy: SelectionPolicy) -> Explanation:
        """Per segment: recomputed flags, check-layer scores (one host copy), cache status and tier."""
        loaded = {s.offset: k for s, k in cached if k not in trace.repaired}
        status: list[tuple[str, str | None]] = []
        for seg in layout.segments:
            if seg.kind == "question" or plan.mode is Mode.FULL_PREFILL:
                status.append(("off", None))
            elif seg.offset in loaded:
                status.append(("hit", tiers.get(loaded[seg.offset])))
            else:
                status.append(("miss", None))
        metric = "none"
        if check_layer is not None and policy.use_deviation:
            metric = f"{policy.metric} deviation" + (" x question attention" if policy.query_weighted else "")
        return build_explanation(layout, final, probe.to_host(), status, check_layer, metric)

    def _repairer(self, seg_of_key: dict[str, Segment], in_context: bool):
        def repair(key: str) -> ChunkKV:
            if in_context:  # a prefix entry vanished mid-stream: cannot rebuild it alone
                raise RuntimeError(f"prefix cache entry {key} vanished while loading")
            logger.warning("chunk %s missing or corrupt; recomputing from its tokens", key)
            return self.precompute(seg_of_key[key].token_ids)

        return repair

    # ------------------------------------------------------------------ prefix caching
    @staticmethod
    def _chain(segs, keys) -> Iterator[tuple[Segment, str, bool]]:
        """Leading cacheable segments with their in-context keys (and whether it is the first)."""
        parent = None
        for seg, key in zip(segs, keys):
            if key is None:
                return
            ck = chain_key(parent, key)
            yield seg, ck, parent is None
            parent = ck

    def _match_prefix(self, segs, keys) -> tuple[list[tuple[Segment, str]], int]:
        """Longest run of leading segments whose in-context KV is in the prefix store."""
        matched: list[tuple[Segment, str]] = []
        for (seg, ck, first), key in zip(self._chain(segs, keys), keys):
            if first and not self.prefix_store.contains(ck):  # sys alone at 0 is exact in context
                kv = self.store.get(key)
                if kv is not None:
                    self.prefix_store.put(ck, kv)
            if not self.prefix_store.contains(ck):
                break
            matched.append((seg, ck))
        return matched, (matched[-1][0].end if matched else 0)

    def _store_prefix(self, segs, keys, cache: KVCache) -> None:
        for seg, ck, _ in self._chain(segs, keys):
            if not self.prefix_store.contains(ck):
                self.prefix_store.put(ck, cache.segment(seg.offset, seg.end))

    # ------------------------------------------------------------------ the layer loop
    def _run_layers(
        self,
        ids: torch.Tensor,
        cached: list[Segment],
        stream,
        fixed_sel: torch.Tensor | None,
        extra: int,
        ratio: float,
        timer: _Timer,
        full_upto: int | None = None,
        policy: SelectionPolicy | None = None,
        layout: PromptLayout | None = None,
        rotate: bool = True,
        probe: ScoreProbe | None = None,
    ) -> tuple[KVCache, torch.Tensor, tuple[list[int], list[int], list[float]]]:
        """Run every layer once.

        - fixed_sel given: only those positions are ever recomputed (full_reuse, prefix_cache).
        - full_upto given (blend): layers 0..full_upto recompute every token; at layer full_upto
          the selection is made from deviations, then narrowed per the policy's schedule.
        - neither: plain causal prefill of every token (full_prefill, precompute).
        Cached segments are stored at 0..T-1 and moved to their offset (`rotate`), except prefix
        cache entries, which were computed in place.
        At the last layer only the last position's output is needed (its logits), so only it
        attends and runs the MLP there; every selected token's K/V are still written.
        Returns (cache, hidden of the last position [1, E], (final selection, sizes, times)).
        """
        r = self.runner
        n_layers, N = r.shape.n_layers, ids.shape[0]
        cache = KVCache(n_layers, r.shape.n_kv_heads, N + extra, r.shape.head_dim, r.dtype, r.device)
        cache.length = N
        pos = torch.arange(N, device=ids.device)  # [N]
        cos_all, sin_all = r.rope(pos)  # [N, D] each
        sel = None if fixed_sel is None else _Selection(fixed_sel, cos_all, sin_all, N)  # None = all tokens
        hidden = r.embed(ids if sel is None else ids[sel.pos])  # [N or S, E]
        ranked = _RankSpace(layout, cached, r.scaling, ids.device, probe) if full_upto is not None else None
        schedule = dict(policy.schedule) if policy is not None else {}
        sizes: list[int] = []
        layers = iter(stream) if stream is not None else None
        placer = _Placer(r, cached, rotate)
        clock = _LayerClock(r.device)

        for layer in range(n_layers):
            checkpoint(f"at layer {layer}")  # a timed-out or abandoned request stops here, not after the prefill
            t0 = time.perf_counter()
            packed = next(layers) if layers is not None else None
            t1 = time.perf_counter()
            timer.wait += t1 - t0
            K, V = cache.k[layer], cache.v[layer]  # [H, C, D] each
            if packed is not None and not (sel is None and full_upto is not None and layer < full_upto):
                placer.place(K, V, packed)  # below the check layer everything is overwritten anyway
            t2 = time.perf_counter()
            timer.assemble += t2 - t1
            clock.mark()

            if sel is None:
                q, k, v = r.qkv(layer, hidden, cos_all, sin_all)  # [Hq, N, D], [H, N, D], [H, N, D]
                if full_upto is not None and layer == full_upto:
                    picked, rows = ranked.select_rows(q, k, v, K, V, ratio * policy.check_multiplier, policy, None)  # [S]
                    sel = _Selection(picked, cos_all, sin_all, N)
                    q, hidden = q[:, rows], hidden[rows]  # [Hq, S, D], [S, E]
                K[:, :N], V[:, :N] = k, v
            else:
                q, k, v = r.qkv(layer, hidden, sel.cos, sel.sin)  # [Hq, S, D], [H, S, D] x2
                keep = None
                if ranked is not None and layer in schedule:
                    narrowed, keep = ranked.select_rows(q, k, v, K, V, ratio * schedule[layer], policy, sel.pos)  # [S']
                K[:, sel.pos], V[:, sel.pos] = k, v
                if keep is not None:
                    q, hidden = q[:, keep], hidden[keep]  # [Hq, S', D], [S', E]
                    sel = _Selection(narrowed, cos_all, sin_all, N)
            if layer == n_layers - 1:  # only the last position's output is used: it alone attends, to every key
                q, hidden = q[:, -1:], hidden[-1:]  # [Hq, 1, D], [1, E]
                out = r.attend(q, K[:, :N], V[:, :N], r.window_mask(layer, pos[-1:], N))  # [1, Hq*D]
            elif sel is None:
                out = r.attend(q, K[:, :N], V[:, :N], r.window_mask(layer, pos, N), causal=True)  # [N, Hq*D]
            else:
                out = sel.attend(r, q, K, V, layer)  # [S, Hq*D]
            hidden = r.finish_layer(layer, hidden, out)  # [S or N, E]
            sizes.append(N if sel is None else sel.pos.shape[0])
            clock.mark()
            timer.compute += time.perf_counter() - t2
        final = list(range(N)) if sel is None else _to_host(sel.pos)  # the request's one host sync
        layer_times = clock.seconds()
        if final[-1] != N - 1:
            raise AssertionError("the last prompt position must always be recomputed")
        return cache, hidden[-1:], (final, sizes, layer_times)

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
        for layer in range(r.shape.n_layers):
            q, k, v = r.qkv(layer, hidden, cos, sin)  # [Hq, 1, D], [H, 1, D], [H, 1, D]
            cache.k[layer][:, p:p + 1] = k
            cache.v[layer][:, p:p + 1] = v
            window = r.window_mask(layer, torch.tensor([p]), p + 1)  # [1, p+1] or None (full attention)
            out = r.attend(q, cache.k[layer][:, :p + 1], cache.v[layer][:, :p + 1], window)  # [1, Hq*D]
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


class Generation:
    """Iterate to receive text deltas as they are decoded; `.result` once exhausted.

    The first delta marks time to first token. Per-request state lives here, never on the engine.
    """

    def __init__(self, engine: BlendEngine, plan: BlendPlan, gen: GenerationConfig) -> None:
        self._engine, self._plan, self._gen = engine, plan, gen
        self.result: BlendResult | None = None
        self.state: PrefillState | None = None
        self.ttft_ms: float | None = None

    def __iter__(self) -> Iterator[str]:
        eng, gen = self._engine, self._gen
        t0 = time.perf_counter()
        state = eng.prefill(self._plan, max_new_tokens=gen.max_tokens)
        self.state = state
        sampler = Sampler(gen.temperature, gen.top_p, gen.seed)
        decoder = StreamDecoder(eng.runner.tokenizer, gen.stop)
        stops = set(eng.runner.eos_token_ids)
        logits = state.logits
        tokens: list[int] = []
        finish = "length"
        for step in range(gen.max_tokens):
            tok = sampler(logits)
            if step == 0:
                self.ttft_ms = (time.perf_counter() - t0) * 1e3
            if tok in stops:
                finish = "stop"
                break
            tokens.append(tok)
            delta, hit_stop = decoder.push(tok)
            if delta:
                yield delta
            if hit_stop:
                finish = "stop"
                break
            if step + 1 < gen.max_tokens:
                logits = eng.decode_step(state.cache, tok)
        tail = decoder.flush()
        if tail:
            yield tail
        total_ms = (time.perf_counter() - t0) * 1e3
        eng.store_missing(state)
        store_ms = (time.perf_counter() - t0) * 1e3 - total_ms
        self.result = BlendResult(
            text=decoder.text,
            token_ids=tuple(tokens),
            finish_reason=finish,
            report=state.report,
            ttft_ms=self.ttft_ms if self.ttft_ms is not None else total_ms,
            total_ms=total_ms,
            store_ms=store_ms,
            explanation=state.explanation,
        )


class _Placer:
    """Writes one layer of cached chunks into the request's cache at their new positions.

    The layer arrives packed (`transfer.PackedLayer`: one contiguous [H, Tc, D] block per K and V,
    already on the device or being copied there). Rotation tables for every cached token's move
    (its segment's offset) are built once per request on the device in fp32; each layer then
    needs one fused rotation in fp32, cast to the compute dtype, and two writes.
    """

    def __init__(self, runner: ModelRunner, cached: list[Segment], rotate: bool) -> None:
        self._dtype = runner.dtype
        spans = [(s.offset, s.end) for s in cached]
        self._contiguous = all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        self._start = spans[0][0] if spans else 0
        self._end = spans[-1][1] if spans else 0
        self._index = torch.cat([torch.arange(a, b) for a, b in spans]).to(runner.device) if spans else None  # [Tc]
        self._rot = None
        if rotate and spans:
            deltas = torch.cat([torch.full((b - a,), a) for a, b in spans])  # [Tc]
            self._rot = runner.rotation(deltas, torch.float32)  # [Tc, D] each, fp32 on the device

    def place(self, K: torch.Tensor, V: torch.Tensor, packed: PackedLayer) -> None:
        """K, V [H, C, D]; packed: the cached chunks' k, v [H, Tc, D] at positions 0..T-1 each."""
        k, v = packed.wait()  # [H, Tc, D] each
        if self._rot is not None:
            k = ModelRunner.apply_rotation(k.float(), *self._rot).to(self._dtype)  # [H, Tc, D]
        if self._contiguous:
            K[:, self._start:self._end] = k
            V[:, self._start:self._end] = v
        else:
            K[:, self._index] = k.to(self._dtype)
            V[:, self._index] = v.to(self._dtype)


class _LayerClock:
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


class _Selection:
    """The positions recomputed at a layer and what attending from them needs, built once per set
    (the set changes only at the check layer and the schedule's layers, not at every layer).

    On the CPU, queries are split into position-ordered blocks; each block reads only the keys up
    to its last position, under an additive causal mask by absolute position: ~S x N / 2 work,
    not S x N (reading a block's last position is free on the host). On a device that would be a
    host sync per set, so there one boolean mask [S, N] by absolute position is built on the
    device (no data-dependent shape) and SDPA keeps its memory-efficient kernel.
    """

    def __init__(self, pos: torch.Tensor, cos_all: torch.Tensor, sin_all: torch.Tensor, n: int,
                 blocks: int = 4) -> None:
        self.pos = pos  # [S] sorted absolute positions
        self.cos, self.sin = cos_all[pos], sin_all[pos]  # [S, D] each
        self._n = n
        self._blocks: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self._mask: torch.Tensor | None = None
        if pos.device.type != "cpu":
            self._mask = torch.arange(n, device=pos.device)[None, :] <= pos[:, None]  # [S, N] bool
            return
        S = pos.numel()
        for idx in torch.tensor_split(torch.arange(S), min(blocks, S)):
            p = pos[idx]  # [s]
            hi = int(p[-1]) + 1  # a host read: free on the CPU
            allowed = torch.arange(hi)[None, :] <= p[:, None]  # [s, hi]
            mask = torch.zeros(allowed.shape, dtype=cos_all.dtype)  # [s, hi]
            self._blocks.append((idx, hi, mask.masked_fill_(~allowed, float("-inf"))))

    def attend(self, r: ModelRunner, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, layer: int) -> torch.Tensor:
        """q [Hq, S, D] of the selected positions over the blended cache K, V [H, C, D]: [S, Hq*D].
        A sliding-window layer uses the model's window mask instead of the causal one."""
        if self._mask is not None:
            window = r.window_mask(layer, self.pos, self._n)  # [S, N] or None
            return r.attend(q, K[:, :self._n], V[:, :self._n], self._mask if window is None else window)  # [S, Hq*D]
        outs = [r.attend(q[:, idx], K[:, :hi], V[:, :hi], self._block_mask(r, layer, idx, hi, mask))
                for idx, hi, mask in self._blocks]  # [s, Hq*D] each
        return torch.cat(outs)  # [S, Hq*D]

    def _block_mask(self, r: ModelRunner, layer: int, idx: torch.Tensor, hi: int, causal: torch.Tensor) -> torch.Tensor:
        window = r.window_mask(layer, self.pos[idx], hi)  # [s, hi] or None
        return causal if window is None else window


_OTHER, _COMPETE, _FORCED = 0, 1, 2


class _RankSpace:
    """Which positions compete for recompute, and how they are ranked.

    Competing: tokens of cached passages. Always kept: uncached tokens (the question, passages that
    missed the cache) and, with EPIC sinks, the first k tokens of each passage. The system prefix
    is never recomputed: cached alone at position 0 it is exact.

        | sys (exact) | passage_1 .. passage_k (compete) | question (always) |

    Selection has fixed sizes known on the host: every row of the current set is scored, forced
    rows get +inf, rows that never compete -inf, and one `topk` of a size computed from counts
    keeps the forced rows plus the best competitors. No host sync, no data-dependent shape.
    """

    def __init__(self, layout: PromptLayout, cached: list[Segment], scale: float,
                 device: torch.device | str = "cpu", probe: ScoreProbe | None = None) -> None:
        self.scale = scale
        self.device = device
        self.probe = probe  # explain: keeps the check layer's scores (device tensors, no sync)
        cached_offsets = {s.offset for s in cached}
        self.n = layout.n_tokens
        self.kind = [_OTHER] * self.n  # per position, on the host
        compete, always = [], []
        self.passages: list[tuple[int, int]] = []
        for seg in layout.segments:
            span = list(range(seg.offset, seg.end))
            if seg.offset not in cached_offsets:
                always += span
            elif seg.kind == "passage":
                compete += span
                self.passages.append((seg.offset, seg.end))
        for i in always:
            self.kind[i] = _FORCED
        for i in compete:
            self.kind[i] = _COMPETE
        self.compete = torch.tensor(compete, dtype=torch.long, device=device)  # [P]
        self.always = torch.tensor(always, dtype=torch.long, device=device)  # [U]
        last = layout.segments[-1]
        self.n_query = last.end - last.offset  # the question: always recomputed, the last Q positions
        self.query = torch.arange(last.offset, last.end, device=device)  # [Q]
        self._base: dict[int, tuple[torch.Tensor, int, int]] = {}

    def base(self, sink_tokens: int) -> tuple[torch.Tensor, int, int]:
        """(score offset per position [N]: +inf forced, -inf never, 0 competing; #forced; #competing)."""
        if sink_tokens not in self._base:
            kind = list(self.kind)
            for s, e in self.passages:
                kind[s:min(s + sink_tokens, e)] = [_FORCED] * (min(s + sink_tokens, e) - s)
            table = {_OTHER: float("-inf"), _COMPETE: 0.0, _FORCED: float("inf")}
            base = torch.tensor([table[c] for c in kind], dtype=torch.float32).to(self.device)  # [N]
            self._base[sink_tokens] = (base, kind.count(_FORCED), kind.count(_COMPETE))
        return self._base[sink_tokens]

    def select(self, q, k, v, K, V, ratio: float, policy: SelectionPolicy, current: torch.Tensor | None) -> torch.Tensor:
        """Positions to keep recomputing, sorted [S']. See `select_rows`."""
        return self.select_rows(q, k, v, K, V, ratio, policy, current)[0]

    def select_rows(self, q, k, v, K, V, ratio: float, policy: SelectionPolicy,
                    current: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions to keep recomputing [S'], their rows in `current`), both sorted.

        q [Hq, S, D], k, v [H, S, D]: fresh values for `current` (None = all N positions);
        K, V [H, C, D]: the blended cache of this layer before the fresh values are written.
        `current` always holds every forced position (they are kept at every narrowing).
        """
        base, n_forced, n_compete = self.base(policy.sink_tokens)
        n_keep = min(len(self.compete), math.ceil(ratio * len(self.compete) - 1e-9))
        S = self.n if current is None else current.shape[0]
        present = n_compete if current is None else S - n_forced  # competitors in the current set
        take = n_forced + (min(n_keep, present) if policy.use_deviation else 0)
        rows_base = base if current is None else base[current]  # [S]
        if policy.use_deviation and take > n_forced:
            old_k = K[:, :S] if current is None else K[:, current]  # [H, S, D]
            old_v = V[:, :S] if current is None else V[:, current]  # [H, S, D]
            score = _deviation(k, v, old_k, old_v, policy.metric, weight=rows_base == 0)  # [S]
            if policy.query_weighted:
                mass = self._attention_mass(q, k, K, current)  # [N]
                score = score * (mass if current is None else mass[current])  # [S]
            if self.probe is not None and current is None:  # rows are positions at the check layer
                self.probe.record(self.compete, score[self.compete])  # [P] each, device tensors
            score = score + rows_base  # [S]
        else:
            score = rows_base  # [S]
        rows = torch.topk(score, take).indices.sort().values  # [S'] rows, sorted = positions sorted
        return (rows if current is None else current[rows]), rows

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


def _deviation(k_new, v_new, k_old, v_old, metric: str, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token squared L2 deviation, summed over heads. Inputs [H, P, D]; output [P].

    For "kv" each part is normalised by its mean over the rows where `weight` [P] is True (the
    competing rows; all rows when None)."""
    dk = (k_new.float() - k_old.float()).pow(2).sum(dim=(0, 2))  # [P]
    if metric == "k":
        return dk
    dv = (v_new.float() - v_old.float()).pow(2).sum(dim=(0, 2))  # [P]
    if metric == "v":
        return dv
    w = torch.ones_like(dk) if weight is None else weight.to(dk.dtype)  # [P]
    n = w.sum().clamp_min(1.0)
    return dk / ((dk * w).sum() / n).clamp_min(1e-12) + dv / ((dv * w).sum() / n).clamp_min(1e-12)


def _to_host(t: torch.Tensor) -> list[int]:
    """THE device->host sync of a prefill: the final recomputed positions, once, after the layer
    loop (the report needs them). Nothing inside the loop reads a device value on the host."""
    return t.tolist()
