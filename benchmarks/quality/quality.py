"""Quality per mode on real multi-hop QA: F1/EM vs gold, agreement and first-token KL vs full prefill."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from benchmarks.common.data import Example, passages_of, shuffled
from benchmarks.common.scoring import bootstrap_ci, exact_match, kl, max_over_golds, paired_bootstrap, token_f1
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store.factory import build_loader, build_store
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.controller import BandwidthController
from blend_engine.types import BlendPlan, GenerationConfig, Mode

logger = logging.getLogger(__name__)

BLEND_RATIOS = (0.05, 0.10, 0.15, 0.30)
REFERENCE = "full_prefill"


@dataclass(frozen=True)
class ModeSpec:
    """One measured configuration. `ratio` None for blend means: the bandwidth controller chooses."""

    name: str
    mode: Mode
    ratio: float | None = None
    shuffle: bool = False
    controller: bool = False


def mode_specs(ratios: tuple[float, ...] = BLEND_RATIOS) -> list[ModeSpec]:
    specs = [ModeSpec(REFERENCE, Mode.FULL_PREFILL), ModeSpec("prefix_cache", Mode.PREFIX_CACHE, shuffle=True),
             ModeSpec("full_reuse", Mode.FULL_REUSE)]
    specs += [ModeSpec(f"blend@{r:.2f}", Mode.BLEND, r) for r in ratios]
    specs.append(ModeSpec("blend@auto", Mode.BLEND, None, controller=True))
    return specs


@dataclass
class Engines:
    """Two engines over one store: a plain one and one with a BandwidthController."""

    plain: BlendEngine
    auto: BlendEngine

    @classmethod
    def build(cls, runner: ModelRunner, memory_bytes: int = 2 << 30) -> Engines:
        store = build_store(memory_bytes=memory_bytes)
        loader = build_loader(store)
        plain = BlendEngine(runner, store, EngineConfig(prefix_caching=False), loader=loader)
        auto = BlendEngine(runner, store, EngineConfig(prefix_caching=False), loader=loader,
                           controller=BandwidthController())
        return cls(plain, auto)

    def pick(self, spec: ModeSpec) -> BlendEngine:
        return self.auto if spec.controller else self.plain


@dataclass(frozen=True)
class Record:
    dataset: str
    id: str
    mode: str
    answer: str
    f1: float
    em: float
    agreement_f1: float
    kl: float
    recompute_ratio: float
    recomputed_tokens: int
    context_tokens: int
    recompute_share: float
    ttft_ms: float
    total_ms: float


def _generate(engine: BlendEngine, plan: BlendPlan, gen: GenerationConfig):
    """(result, first-token logits [V]) of one generation; the prefill is shared."""
    g = engine.generate(plan, gen)
    for _ in g:
        pass
    return g.result, g.state.logits


def run_example(ex: Example, engines: Engines, specs: list[ModeSpec], gen: GenerationConfig,
                max_paragraphs: int | None = None, group_words: int | None = None) -> list[Record]:
    """Every mode on one example; the reference (full prefill) runs first."""
    passages = passages_of(ex, max_paragraphs, group_words)
    for p in passages:
        engines.plain.ensure_cached(p)
    ref_answer, ref_logits = "", None
    out: list[Record] = []
    for spec in specs:
        engine = engines.pick(spec)
        order = passages
        if spec.shuffle:  # populate the prefix cache in the original order, measure on a shuffled one
            engine.prefill(BlendPlan(passages, ex.question, mode=spec.mode))
            order = shuffled(passages, ex.id)
        plan = BlendPlan(order, ex.question, mode=spec.mode, recompute_ratio=spec.ratio)
        result, logits = _generate(engine, plan, gen)
        if spec.name == REFERENCE:
            ref_answer, ref_logits = result.text, logits
        rep = result.report
        out.append(Record(
            dataset=ex.dataset, id=ex.id, mode=spec.name, answer=result.text.strip(),
            f1=max_over_golds(token_f1, result.text, ex.answers),
            em=max_over_golds(exact_match, result.text, ex.answers),
            agreement_f1=token_f1(result.text, ref_answer),
            kl=kl(ref_logits, logits) if ref_logits is not None else float("nan"),
            recompute_ratio=rep.recompute_ratio, recomputed_tokens=rep.recomputed_tokens,
            context_tokens=rep.context_tokens, recompute_share=rep.recomputed_tokens / rep.context_tokens,
            ttft_ms=result.ttft_ms, total_ms=result.total_ms,
        ))
    return out


def run_quality(examples: list[Example], runner: ModelRunner, specs: list[ModeSpec] | None = None,
                max_tokens: int = 32, max_paragraphs: int | None = None,
                group_words: int | None = None) -> list[Record]:
    specs = specs or mode_specs()
    if specs[0].name != REFERENCE:
        raise ValueError("the reference mode (full_prefill) must come first")
    engines = Engines.build(runner)
    gen = GenerationConfig(max_tokens=max_tokens, temperature=0.0, stop=("\n",))
    records: list[Record] = []
    for i, ex in enumerate(examples, 1):
        t0 = time.perf_counter()
        recs = run_example(ex, engines, specs, gen, max_paragraphs, group_words)
        records += recs
        logger.info("quality %d/%d %s %s: %.0f s; %s", i, len(examples), ex.dataset, ex.id, time.perf_counter() - t0,
                    " ".join(f"{r.mode}={r.f1:.2f}" for r in recs))
    return records


# ---------------------------------------------------------------------- summaries
METRICS = ("f1", "em", "agreement_f1", "kl", "recompute_share", "ttft_ms")


def _by(records: list[Record], dataset: str | None, mode: str) -> list[Record]:
    rows = [r for r in records if r.mode == mode and (dataset is None or r.dataset == dataset)]
    return sorted(rows, key=lambda r: (r.dataset, r.id))


def summarize(records: list[Record], n_resamples: int = 1000) -> dict:
    """Per (dataset|all) x mode: mean and 95% bootstrap CI of each metric; paired differences; goal checks."""
    datasets = sorted({r.dataset for r in records})
    modes = list(dict.fromkeys(r.mode for r in records))
    table: dict = {}
    for ds in [*datasets, "all"]:
        key = None if ds == "all" else ds
        table[ds] = {}
        for m in modes:
            rows = _by(records, key, m)
            stats = {k: _ci([getattr(r, k) for r in rows], n_resamples) for k in METRICS}
            stats["n"] = len(rows)
            stats["mean_ratio"] = sum(r.recompute_ratio for r in rows) / max(1, len(rows))
            table[ds][m] = stats
    diffs = {ds: _paired_diffs(records, None if ds == "all" else ds, modes, n_resamples) for ds in [*datasets, "all"]}
    return {"table": table, "paired": diffs, "goals": goals(table, diffs)}


def _ci(values: list[float], n_resamples: int) -> dict:
    mean, low, high = bootstrap_ci(values, n_resamples)
    return {"mean": mean, "low": low, "high": high}


def _paired_diffs(records: list[Record], dataset: str | None, modes: list[str], n_resamples: int) -> dict:
    """Paired differences "a - b (metric)": every mode against full prefill on F1; blend@0.15 against
    full reuse (the floor it must beat) and against prefix_cache on a shuffled order (an exact prefill
    of the same passages in another order: how much order alone moves the scores) on F1 and agreement."""
    pairs = [(m, REFERENCE, ("f1",)) for m in modes if m != REFERENCE]
    pairs += [("blend@0.15", other, ("f1", "agreement_f1")) for other in ("full_reuse", "prefix_cache")]
    out = {}
    for a, b, metrics in pairs:
        rows_a, rows_b = _by(records, dataset, a), _by(records, dataset, b)
        if not rows_a or [r.id for r in rows_a] != [r.id for r in rows_b]:
            continue
        for metric in metrics:
            out[f"{a} - {b} ({metric})"] = _diff(
                [getattr(r, metric) for r in rows_a], [getattr(r, metric) for r in rows_b], n_resamples)
    return out


def _diff(a: list[float], b: list[float], n_resamples: int) -> dict:
    mean, low, high = paired_bootstrap(a, b, n_resamples)
    return {"mean": mean, "low": low, "high": high}


def goals(table: dict, diffs: dict) -> dict:
    """The issue's targets on the pooled data: blend@0.15 close to full prefill, full reuse below it."""
    t, d = table.get("all", {}), diffs.get("all", {})
    if "blend@0.15" not in t or "full_reuse" not in t:
        return {}
    gap = d.get(f"blend@0.15 - {REFERENCE} (f1)", {"mean": float("nan")})
    vs_reuse = d.get("blend@0.15 - full_reuse (f1)", {"low": float("nan")})
    agree_reuse = d.get("blend@0.15 - full_reuse (agreement_f1)", {"low": float("nan")})
    vs_order = d.get("blend@0.15 - prefix_cache (f1)", {"mean": float("nan")})
    return {
        "blend015_f1_gap": gap["mean"],
        "blend015_within_0.02_f1": abs(gap["mean"]) <= 0.02,
        "blend015_agreement_f1": t["blend@0.15"]["agreement_f1"]["mean"],
        "blend015_agreement_ge_0.85": t["blend@0.15"]["agreement_f1"]["mean"] >= 0.85,
        "full_reuse_below_on_f1": vs_reuse["low"] > 0,
        "full_reuse_below_on_agreement": agree_reuse["low"] > 0,
        "blend015_f1_minus_reordered_exact_prefill": vs_order["mean"],
    }


def records_as_dicts(records: list[Record]) -> list[dict]:
    return [asdict(r) for r in records]
