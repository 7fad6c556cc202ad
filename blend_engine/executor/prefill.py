"""One prefill as the executor runs it: a scheduler's `ModePlan` (integer spans) in, tensors out.

    | sys | chunk_1 .. chunk_k | question |
      loaded layer by layer (`kv_store.loader`), placed by RoPE (`placement`), repaired by the
      selection (`selection`) in the layer loop (`layers.LayerLoop`)

`PrefillRun.steps()` runs one layer per step; the engine loop instead drives it one layer at a
time (`enter`, then its rows in a `layers.layer_pass` beside other requests' rows, then `leave`),
so a long prefill spreads over several engine steps and shares each layer's projections with the
batch's decode rows. `finish()` reads the final positions (the prefill's one host sync) and builds
the report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from blend_engine.explain import Explanation, ScoreProbe, build_explanation, tier_of
from blend_engine.kv_store import ChunkKV
from blend_engine.kv_store.loader import LayerLoader, LoadTrace
from blend_engine.layout import PromptLayout
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.plans import ModePlan, Span
from blend_engine.transfer import LayerPacker
from blend_engine.types import BlendPlan, BlendReport, Mode, SelectionPolicy

from .layers import SERVING, KVCache, LayerHooks, LayerJob, LayerLoop, LayerOutput, Timer
from .uploads import span_ranges, upload, upload_ints

logger = logging.getLogger(__name__)


@dataclass
class PrefillState:
    """The outcome of a prefill: cache, last-position logits [V], report. Per request only."""

    cache: KVCache
    logits: torch.Tensor
    report: BlendReport
    layout: PromptLayout
    missing: list[int]  # segment indices whose alone-KV should be stored after answering
    explanation: Explanation | None = None  # only when the plan asked for it


def span_positions(spans: tuple[Span, ...], device: torch.device) -> torch.Tensor:
    """Integer spans [start, end) as one sorted position tensor [S] on the device (one upload)."""
    return upload(span_ranges(spans), device)  # [S]


class PrefillRun:
    """The tensors of one prefill. Built on the thread that runs it; `steps()` then `finish()`."""

    def __init__(self, runner: ModelRunner, loader: LayerLoader, plan: BlendPlan, layout: PromptLayout,
                 mp: ModePlan, policy: SelectionPolicy, extra: int, attention: str,
                 rebuild: Callable[[tuple[int, ...]], ChunkKV], hooks: LayerHooks = SERVING,
                 cache: KVCache | None = None) -> None:
        self.t_start = time.perf_counter()
        self.runner, self.plan, self.layout, self.mp, self.policy = runner, plan, layout, mp, policy
        ids = upload_ints(layout.token_ids(), runner.device)  # [N]
        self.probe = ScoreProbe() if plan.explain else None
        # tiers before loading promotes them
        self.tiers = {k: tier_of(mp.store, k) for _, k in mp.cached} if plan.explain else {}
        self.stream = _stream(runner, loader, mp, rebuild)
        recompute = None if mp.recompute is None else span_positions(mp.recompute, runner.device)  # [S]
        self.job = LayerJob(ids, extra, tuple(s for s, _ in mp.cached), self.stream, recompute, mp.check_layer,
                            mp.ratio, policy, layout, probe=self.probe, attention=attention,
                            hooks=hooks, cache=cache)
        self.loop = LayerLoop(runner, self.job)

    def steps(self) -> Iterator[int]:
        """One layer per step (yields the tokens it computed); the loader stream closes at the end."""
        try:
            yield from self.loop.steps()
        finally:
            self.close()

    # one layer at a time beside other rows (the engine loop's fused step, `layers.layer_pass`)
    @property
    def next_layer(self) -> int:
        return self.loop.layer

    @property
    def done(self) -> bool:
        return self.loop.layer == self.runner.shape.n_layers

    @property
    def shared(self) -> bool:
        """Some layer ran in a pass with other rows: its layer times count them too."""
        return self.loop.shared

    @property
    def rows(self) -> int:
        """The rows its next layer computes (a host int: no sync)."""
        return self.loop.hidden.shape[0]

    def enter(self) -> LayerLoop:
        """Load and place its next layer; the loop, a row group for that layer's `layer_pass`."""
        self.loop.enter()
        return self.loop

    def leave(self) -> None:
        """Its layer is computed; after the last one the loader stream closes."""
        self.loop.leave()
        if self.done:
            self.close()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()

    def finish(self) -> PrefillState:
        """After the last step: logits of the last position, the report, the explanation."""
        out = self.loop.output()
        final = _final_positions(out, self.layout.n_tokens)
        logits = self.runner.logits(out.last_hidden)[0]  # [V]
        trace = self.stream.trace if self.stream is not None else LoadTrace()
        report = _report(self.mp, self.layout, out, final, out.clock.seconds(), trace, self.job.timer, self.t_start)
        explanation = None
        if self.probe is not None:
            explanation = _explain(self.plan, self.layout, final, self.probe, self.mp, self.tiers, trace, self.policy)
        return PrefillState(out.cache, logits, report, self.layout, list(self.mp.missing), explanation)


def _stream(runner: ModelRunner, loader: LayerLoader, mp: ModePlan, rebuild: Callable[[tuple[int, ...]], ChunkKV]):
    """The layer stream of the plan's cached chunks, packed for the device (None: nothing cached)."""
    if not mp.cached:
        return None
    seg_of_key = {k: s for s, k in mp.cached}

    def repair(key: str) -> ChunkKV:
        logger.warning("chunk %s missing or corrupt; recomputing from its tokens", key)
        return rebuild(seg_of_key[key].token_ids)

    loader = loader if mp.store is loader.store else LayerLoader(mp.store)
    packer = LayerPacker(runner.device, runner.dtype, slots=loader.prefetch_depth + 2)
    whole = range(mp.check_layer) if mp.check_layer is not None and mp.recompute is None else ()  # never loaded
    return loader.stream([k for _, k in mp.cached], runner.shape.n_layers, repair, packer,
                         stored=packer.moves_int8, skip=whole)  # int8 moves as int8, dequantized on the device


def _final_positions(out: LayerOutput, n: int) -> list[int]:
    final = list(range(n)) if out.selected is None else _to_host(out.selected)  # the request's one host sync
    if final[-1] != n - 1:
        raise AssertionError("the last prompt position must always be recomputed")
    return final


def _to_host(t: torch.Tensor) -> list[int]:
    """THE device->host sync of a prefill: the final recomputed positions, once, after the layer
    loop (the report needs them). Nothing inside the loop reads a device value on the host."""
    return t.tolist()


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


def _report(mp: ModePlan, layout: PromptLayout, out: LayerOutput, final: list[int], layer_times: list[float],
            trace: LoadTrace, timer: Timer, t_start: float) -> BlendReport:
    return BlendReport(
        mode=mp.mode.value,
        recompute_ratio=mp.ratio,
        ratio_source=mp.source.value,
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
        layer_wait_ms=tuple(x * 1e3 for x in trace.wait_s),
    )


__all__ = ["PrefillRun", "PrefillState", "span_positions"]
