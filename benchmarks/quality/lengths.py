"""Blend fidelity across passage lengths (`python -m benchmarks.ttft.engine --lengths 0,200,400,600`).

Every dev question's paragraphs are laid out as passages, one per paragraph (length 0) or grouped
to ~N words (`data.passages_of`, the grouping `benchmarks.run --group-words` uses). Per question
and length the references are computed once and cached on disk (`--ref-cache`), so variants added
later re-use them:

- full prefill: its greedy answer and first-token logits (the reference of everything);
- full reuse: its first-token KL to full prefill (the denominator of the KL ratio);
- full prefill with the passages reordered: its top-1 agreement with full prefill (the noise
  floor of top-1: an exact prefill of the same passages in another order).

Each variant (ratio, policy) is then scored per question: first-token KL and top-1 agreement
with full prefill, token F1 of its answer against full prefill's, gold F1, recomputed share.
The questions split into halves: the first half tunes, the second reports (`--half`).

The "oracle-..." variants (`benchmarks.quality.oracle`) bound what any selection of the same count could
do: the tokens are chosen by their true deviation from the full prefill, then recomputed ("select")
or given the exact K/V ("fix"); first token only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common.data import Example, passages_of, shuffled
from benchmarks.common.policies import PREVIOUS_DEFAULT, previous_default
from benchmarks.common.scoring import kl, max_over_golds, token_f1
from benchmarks.quality.oracle import LazyRefs, OracleRefs, oracle_first_token
from blend_engine.engine import BlendEngine
from blend_engine.types import BlendPlan, GenerationConfig, SelectionPolicy

logger = logging.getLogger(__name__)

MAX_ANSWER_TOKENS = 32
ORACLE_VERSION = 1  # enters the oracle variants' cache keys: bump when what they compute changes


@dataclass(frozen=True)
class Variant:
    """A blend run: its ratio, policy (None: the engine's default) and optional ratio growth with
    passage length: ratio x clamp(mean passage tokens / grow_ref, 1, grow_cap) ** grow_power."""

    ratio: float
    policy: SelectionPolicy | None = None
    grow_ref: float = 0.0  # 0: fixed ratio
    grow_power: float = 1.0
    grow_cap: float = 1.0
    sinks_in_budget: bool = False  # the policy's boundary tokens (sinks, ends) come out of the ratio (same total recomputed)
    oracle: str = ""  # "select" / "select-sched" / "fix": issue #28's oracle bound (`oracle.py` here), first token only
    oracle_rank: str = "deviation"  # the oracle's ranking (`oracle.RANKS`)

    def ratio_for(self, passage_tokens: list[int]) -> float:
        ratio = self.ratio
        if self.grow_ref:
            scale = min(max(statistics.fmean(passage_tokens) / self.grow_ref, 1.0), self.grow_cap)
            ratio = min(1.0, self.ratio * scale ** self.grow_power)
        if self.sinks_in_budget and self.policy is not None:
            sinks = sum(min(self.policy.sink_tokens + self.policy.end_tokens, n) for n in passage_tokens)
            ratio = max(0.0, (ratio * sum(passage_tokens) - sinks) / max(sum(passage_tokens) - sinks, 1))
        return ratio

    def key(self, ratio: float) -> str:
        """What a run at this (effective) ratio does, not the variant's name: the result cache's key,
        shared by variants that run the same thing (a grown ratio that did not grow)."""
        if self.oracle:
            what = ("oracle", self.oracle, self.oracle_rank, ratio, ORACLE_VERSION)
            return hashlib.sha1(repr(what).encode()).hexdigest()[:16]
        return hashlib.sha1(repr((ratio, self.policy or SelectionPolicy(), 0.0, 1.0, 1.0)).encode()).hexdigest()[:16]


_d = previous_default  # the default policy before issue #28 with some fields changed


# The options of issue #28, each a change to the previous default at ratio 0.15 unless named
# otherwise; the previous default at 0.15 and 0.30. "sinks 8 + check@2" won and is the default now.
SWEEP: dict[str, Variant] = {
    "blend@0.15 default": Variant(0.15, PREVIOUS_DEFAULT),
    "blend@0.30 default": Variant(0.30, PREVIOUS_DEFAULT),
    "alloc by length": Variant(0.15, _d(allocation="length")),
    "alloc by question attention": Variant(0.15, _d(allocation="attention")),
    "sinks 8 (EPIC)": Variant(0.15, _d(sink_tokens=8)),
    "sinks 8 within the 0.15 budget": Variant(0.15, _d(sink_tokens=8), sinks_in_budget=True),
    "sinks 8 + check@2": Variant(0.15, _d(sink_tokens=8, check_layer=2, schedule=((3, 2.0), (4, 1.5), (5, 1.0)))),
    "check@2, 4x>2x>1.5x>1x by 5": Variant(0.15, _d(check_layer=2, schedule=((3, 2.0), (4, 1.5), (5, 1.0)))),
    "query mass running over layers": Variant(0.15, _d(query_mass="running")),
    "ratio grows with length (sqrt, from 128 tok, cap 4x)": Variant(0.15, grow_ref=128.0, grow_power=0.5, grow_cap=4.0),
    # second round (helper session of 2026-12-02): sink sizes, EPIC's end boundary, APE
    "sinks 4 on top": Variant(0.15, _d(sink_tokens=4)),
    "sinks 4 within": Variant(0.15, _d(sink_tokens=4), sinks_in_budget=True),
    "sinks 16 on top": Variant(0.15, _d(sink_tokens=16)),
    "sinks 16 within": Variant(0.15, _d(sink_tokens=16), sinks_in_budget=True),
    "first+last 4 on top": Variant(0.15, _d(sink_tokens=4, end_tokens=4)),
    "first+last 4 within": Variant(0.15, _d(sink_tokens=4, end_tokens=4), sinks_in_budget=True),
    "first+last 8 on top": Variant(0.15, _d(sink_tokens=8, end_tokens=8)),
    "first+last 8 within": Variant(0.15, _d(sink_tokens=8, end_tokens=8), sinks_in_budget=True),
    "APE T0.9 S0.9": Variant(0.15, _d(ape_temperature=0.9, ape_scale=0.9)),
    "APE T0.9 S1": Variant(0.15, _d(ape_temperature=0.9)),
    "APE T0.8 S0.8": Variant(0.15, _d(ape_temperature=0.8, ape_scale=0.8)),
    "APE T1 S0.9": Variant(0.15, _d(ape_scale=0.9)),
    # third round: the oracle bound (`benchmarks.quality.oracle`): the same count of tokens as the default
    # keeps at the ratio, chosen by the true deviation from the full prefill ("qa": x the full
    # prefill's question attention); recomputed ("select") or given the exact K/V ("fix")
    **{f"oracle-select@{r:.2f}": Variant(r, oracle="select") for r in (0.15, 0.30)},
    **{f"oracle-fix@{r:.2f}": Variant(r, oracle="fix") for r in (0.05, 0.15, 0.30, 0.50, 0.70, 1.00)},
    **{f"oracle-select sched@{r:.2f}": Variant(r, oracle="select-sched") for r in (0.15, 0.30)},
    "oracle-select qa@0.15": Variant(0.15, oracle="select", oracle_rank="qa"),
    "oracle-fix qa@0.15": Variant(0.15, oracle="fix", oracle_rank="qa"),
    # ranked by integrated gradients of the first token's KL (the fix's own objective)
    **{f"oracle-fix ig@{r:.2f}": Variant(r, oracle="fix", oracle_rank="ig") for r in (0.05, 0.15, 0.30, 0.50)},
    **{f"oracle-select ig@{r:.2f}": Variant(r, oracle="select", oracle_rank="ig") for r in (0.15, 0.30)},
}


def policy_options() -> dict[str, SelectionPolicy]:
    """The sweep's options that are a policy alone (a fixed ratio): the engine ablation's rows too."""
    return {name: v.policy for name, v in SWEEP.items()
            if v.policy is not None and not v.grow_ref and not v.sinks_in_budget and not v.oracle}


@dataclass
class Cell:
    """One (dataset, length) cell's per-question records."""

    dataset: str
    group_words: int
    refs: list[dict] = field(default_factory=list)
    runs: dict[str, list[dict]] = field(default_factory=dict)


class RefCache:
    """Per-question references and variant results, kept on disk between runs (JSON + logits .pt)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.logits_path = path.with_suffix(".pt")
        self.data: dict = json.loads(path.read_text()) if path.exists() else {}
        self.logits: dict[str, torch.Tensor] = torch.load(self.logits_path) if self.logits_path.exists() else {}

    def save(self) -> None:
        """Write, merged with what another run of the same dataset wrote meanwhile (under a file lock)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            on_disk = json.loads(self.path.read_text()) if self.path.exists() else {}
            for key, entry in on_disk.items():
                mine = self.data.setdefault(key, entry)
                mine["ref"] = {**entry["ref"], **mine["ref"]}
                mine["runs"] = {**entry["runs"], **mine["runs"]}
            if self.logits_path.exists():
                self.logits = {**torch.load(self.logits_path), **self.logits}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            tmp.replace(self.path)
            torch.save(self.logits, self.logits_path.with_suffix(".pt.tmp"))
            self.logits_path.with_suffix(".pt.tmp").replace(self.logits_path)


def _answer(engine: BlendEngine, plan: BlendPlan) -> tuple[str, torch.Tensor, int]:
    """Greedy answer (to the first newline), first-token logits [V], recomputed tokens."""
    gen = engine.generate(plan, GenerationConfig(max_tokens=MAX_ANSWER_TOKENS, stop=("\n",)))
    for _ in gen:
        pass
    text = engine.runner.decode(list(gen.result.token_ids)).split("\n")[0].strip()
    # detached: logits kept in the reference cache must hold no autograd graph (the engine loop's
    # prefill recorded one before d16a0d2: each question's whole prefill, ~2 GB, stayed alive)
    return text, gen.state.logits.detach(), gen.state.report.recomputed_tokens


def _first_logits(engine: BlendEngine, plan: BlendPlan) -> torch.Tensor:
    return engine.prefill(plan, max_new_tokens=1).logits  # [V]


def cache_segments(engine: BlendEngine, plan: BlendPlan) -> None:
    """Store the system prefix and every passage first: a system prefix that missed the cache would
    be recomputed (exactly) by the first full reuse or blend of a run, and flatter it."""
    for seg in engine.layout(plan).segments:
        if seg.kind != "question":
            engine.cache_ids(seg.token_ids)


def reference(engine: BlendEngine, cache: RefCache, key: str, row: Example, passages: tuple[str, ...],
              reordered: bool) -> dict:
    """Full prefill's answer and logits, full reuse's KL and (`reordered`) the reordered prefill's
    top-1; each computed once and cached."""
    if key not in cache.data or key not in cache.logits:
        text, logits, _ = _answer(engine, BlendPlan(passages, row.question, mode="full_prefill"))
        reuse = _first_logits(engine, BlendPlan(passages, row.question, mode="full_reuse"))
        cache.data[key] = {"ref": {
            "answer": text, "gold_f1": max_over_golds(token_f1, text, row.answers), "full_reuse_kl": kl(logits, reuse),
            "context_tokens": engine.layout(BlendPlan(passages, row.question)).n_tokens, "passages": len(passages),
            "passage_tokens": [len(engine.passage_tokens(p)) for p in passages]}, "runs": {}}
        cache.logits[key] = logits.float().cpu()
    ref = cache.data[key]["ref"]
    if reordered and "reordered_top1" not in ref:
        full = cache.logits[key]
        other = _first_logits(engine, BlendPlan(shuffled(passages, row.id), row.question, mode="full_prefill"))
        ref |= {"reordered_top1": float(torch.argmax(other) == torch.argmax(full)), "reordered_kl": kl(full, other)}
    return ref


def run_variant(engine: BlendEngine, cache: RefCache, key: str, row: Example, passages: tuple[str, ...],
                variant: Variant, answers: bool, oracle_refs: Callable[[], OracleRefs] | None = None) -> dict:
    """One variant on one question, scored against the cached reference (cached too). Without
    `answers` only the first token is computed (KL, top-1): no answer F1. An oracle variant computes
    the first token only, whatever `answers` says, from `oracle_refs` (computed on first use)."""
    runs, ref = cache.data[key]["runs"], cache.data[key]["ref"]
    ratio = variant.ratio_for(ref["passage_tokens"])
    vkey = variant.key(ratio)
    if vkey in runs and ("f1_vs_full" in runs[vkey] or not answers or variant.oracle):
        return runs[vkey]
    plan = BlendPlan(passages, row.question, mode="blend", recompute_ratio=ratio, policy=variant.policy)
    full = cache.logits[key]
    if variant.oracle:
        if oracle_refs is None:
            raise ValueError(f"oracle variant {variant.oracle!r} needs the question's oracle references")
        logits, recomputed = oracle_first_token(engine, plan, oracle_refs(), variant.oracle, variant.oracle_rank, ratio)
        scores: dict = {}
    elif answers:
        text, logits, recomputed = _answer(engine, plan)
        scores = {"f1_vs_full": token_f1(text, ref["answer"]), "gold_f1": max_over_golds(token_f1, text, row.answers)}
    else:
        state = engine.prefill(plan, max_new_tokens=1)
        logits, recomputed, scores = state.logits, state.report.recomputed_tokens, {}
    runs[vkey] = {"kl": kl(full, logits), "top1": float(torch.argmax(full) == torch.argmax(logits)),
                  "recomputed": recomputed / ref["context_tokens"], "ratio": ratio} | top1_detail(full, logits) | scores
    return runs[vkey]


def dataset_cache(cache_path: Path, dataset: str) -> Path:
    """Each dataset's own cache file: `cache_path` with the dataset's name appended to its stem."""
    return cache_path.with_name(f"{cache_path.stem}_{dataset}{cache_path.suffix}")


def cell_key(model: str, dataset: str, words: int, row: Example) -> str:
    """A question's entry in its dataset's cache, at one passage length (0: one paragraph)."""
    return f"{model}|{dataset}|{words}|{row.id}"


def sweep(engine: BlendEngine | None, model: str, datasets: dict[str, list[Example]], lengths: list[int],
          variants: dict[str, Variant], cache_path: Path, answers: bool = True,
          progress: Callable[[str], None] = logger.info) -> list[Cell]:
    """Every (dataset, length) cell over its questions: references, then each variant. Each dataset
    has its own cache file (`cache_path` with the dataset's name appended), so runs over different
    datasets can go side by side. Without `answers`: first-token scores only, no reordered prefill.
    Without an engine: the cache alone (`cached_only`), nothing is computed."""
    if engine is None:
        return cached_only(model, datasets, lengths, variants, cache_path, answers)
    cells = []
    for name, rows in datasets.items():
        cache = RefCache(dataset_cache(cache_path, name))
        for words in lengths:
            cell = Cell(name, words)
            for i, row in enumerate(rows):
                passages = passages_of(row, group_words=words or None)
                cache_segments(engine, BlendPlan(passages, row.question))
                key = cell_key(model, name, words, row)
                cell.refs.append(reference(engine, cache, key, row, passages, reordered=answers))
                cache.save()
                refs = LazyRefs(engine, BlendPlan(passages, row.question))  # computed only if an oracle runs
                for vname, variant in variants.items():
                    cell.runs.setdefault(vname, []).append(
                        run_variant(engine, cache, key, row, passages, variant, answers, refs))
                    cache.save()  # an interrupted run keeps what it measured
                del refs
                progress(f"{name} ~{words or 'para'} words: question {i + 1}/{len(rows)} done")
            cells.append(cell)
    return cells


def cached_only(model: str, datasets: dict[str, list[Example]], lengths: list[int], variants: dict[str, Variant],
                cache_path: Path, answers: bool) -> list[Cell]:
    """The cells as far as the cache holds them: a question enters a cell only when its reference
    and every variant's result are cached (with answers, when `answers`), so each cell's variants
    share their questions; its n says how many. Nothing is computed (no model)."""
    cells = []
    for name, rows in datasets.items():
        path = dataset_cache(cache_path, name)
        data = json.loads(path.read_text()) if path.exists() else {}
        for words in lengths:
            cell = Cell(name, words)
            for row in rows:
                entry = data.get(cell_key(model, name, words, row))
                if entry is None or (answers and "reordered_top1" not in entry["ref"]):
                    continue
                runs = [entry["runs"].get(v.key(v.ratio_for(entry["ref"]["passage_tokens"]))) for v in variants.values()]
                if any(r is None or (answers and not v.oracle and "f1_vs_full" not in r)
                       for r, v in zip(runs, variants.values())):
                    continue
                cell.refs.append(entry["ref"])
                for vname, run in zip(variants, runs):
                    cell.runs.setdefault(vname, []).append(run)
            if cell.refs:
                cells.append(cell)
    return cells


def top1_detail(full: torch.Tensor, logits: torch.Tensor) -> dict:
    """Where a run's top-1 stands in full prefill's first-token logits [V]: its rank there (0: the
    same token), full prefill's logit gap between its own top-1 and the run's, and between its top-1
    and top-2 (a near tie or a real miss)."""
    full = full.float()
    mine = int(torch.argmax(logits))
    top2 = torch.topk(full, 2).values
    p = torch.softmax(full.double(), -1)
    return {"top1_id": mine, "full_rank_of_top1": int((full > full[mine]).sum()),
            "full_gap_to_top1": float(top2[0] - full[mine]), "full_top2_gap": float(top2[0] - top2[1]),
            "full_p_top1": float(p.max()), "full_p_of_top1": float(p[mine])}


def explain_misses(engine: BlendEngine | None, model: str, datasets: dict[str, list[Example]], lengths: list[int],
                   variants: dict[str, Variant], cache_path: Path) -> list[dict]:
    """Every cached question where a variant's top-1 or the reordered prefill's differs from full
    prefill's: where it stands in full prefill's logits (`top1_detail`: a near tie or a real miss).
    Runs cached before the detail was recorded are recomputed (first token) when an engine is
    given, and the detail added to the cache; without one only what the cache holds is listed."""
    out = []
    for name, rows in datasets.items():
        cache = RefCache(dataset_cache(cache_path, name))
        for words in lengths:
            for row in rows:
                key = cell_key(model, name, words, row)
                entry = cache.data.get(key)
                if entry is None or key not in cache.logits:
                    continue
                ref, full = entry["ref"], cache.logits[key]
                passages = passages_of(row, group_words=words or None)
                misses = {}
                for vname, v in variants.items():
                    ratio = v.ratio_for(ref["passage_tokens"])
                    run = entry["runs"].get(v.key(ratio))
                    if run is None or run["top1"] == 1.0:
                        continue
                    if "top1_id" not in run and engine is not None and not v.oracle:
                        cache_segments(engine, BlendPlan(passages, row.question))
                        plan = BlendPlan(passages, row.question, mode="blend", recompute_ratio=ratio, policy=v.policy)
                        logits = engine.prefill(plan, max_new_tokens=1).logits
                        if abs(kl(full, logits) - run["kl"]) > 1e-3 * max(run["kl"], 1e-3):
                            logger.warning("%s %s: recomputed KL %.4f differs from the cached %.4f",
                                           key, vname, kl(full, logits), run["kl"])
                        run |= top1_detail(full, logits)
                    misses[vname] = {k: run.get(k) for k in ("kl", "full_rank_of_top1", "full_gap_to_top1")}
                if ref.get("reordered_top1") == 0.0 and "reordered_detail" not in ref and engine is not None:
                    cache_segments(engine, BlendPlan(passages, row.question))
                    other = _first_logits(engine, BlendPlan(shuffled(passages, row.id), row.question, mode="full_prefill"))
                    ref["reordered_detail"] = top1_detail(full, other)
                if not misses and ref.get("reordered_top1") != 0.0:
                    continue
                detail = top1_detail(full, full)
                out.append({"dataset": name, "group_words": words, "id": row.id,
                            "full_top2_gap": detail["full_top2_gap"], "full_p_top1": detail["full_p_top1"],
                            "reordered_top1": ref.get("reordered_top1"), "reordered": ref.get("reordered_detail"),
                            "misses": misses})
            cache.save()
    return out


def print_misses(misses: list[dict]) -> None:
    print("\nTop-1 disagreements with full prefill (gap: full prefill's logit gap; rank: of the other top-1 in"
          " full prefill's logits, 1 = its second choice)")
    for m in misses:
        reord = m["reordered"]
        r = "agrees" if m["reordered_top1"] == 1.0 else (
            "?" if reord is None else f"rank {reord['full_rank_of_top1']}, gap {reord['full_gap_to_top1']:.2f}")
        print(f"  {m['dataset']} ~{m['group_words'] or 'para'} {m['id']}: full top1-top2 gap {m['full_top2_gap']:.2f}"
              f" (p top1 {m['full_p_top1']:.2f}); reordered prefill {r}")
        for vname, d in m["misses"].items():
            rank = "?" if d["full_rank_of_top1"] is None else d["full_rank_of_top1"]
            gap = "?" if d["full_gap_to_top1"] is None else f"{d['full_gap_to_top1']:.2f}"
            print(f"    {vname:<40} rank {rank}, gap {gap}, KL {d['kl']:.3f}")


def _mean(records: list[dict], key: str) -> float | None:
    """Mean of a score over records, None when some record lacks it (a first-token-only run)."""
    values = [r.get(key) for r in records]
    return None if any(v is None for v in values) else statistics.fmean(values)


def summarize(cell: Cell) -> dict:
    """Per variant: KL ratio to full reuse (mean KL / full reuse's mean KL), mean KL, top-1 agreement,
    F1 vs full prefill, gold F1 (and its difference to full prefill's), recomputed share; with the
    cell's references. Scores a run did not compute are None."""
    reuse_kl = statistics.fmean(r["full_reuse_kl"] for r in cell.refs)
    out = {"dataset": cell.dataset, "group_words": cell.group_words, "n": len(cell.refs),
           "context_tokens": statistics.fmean(r["context_tokens"] for r in cell.refs),
           "passages": statistics.fmean(r["passages"] for r in cell.refs),
           "passage_tokens": statistics.fmean(t for r in cell.refs for t in r["passage_tokens"]),
           "full_reuse_kl": reuse_kl, "full_prefill_gold_f1": _mean(cell.refs, "gold_f1"),
           "reordered_top1": _mean(cell.refs, "reordered_top1"), "reordered_kl": _mean(cell.refs, "reordered_kl"),
           "variants": {}}
    for name, runs in cell.runs.items():
        m = {k: _mean(runs, k) for k in ("kl", "top1", "f1_vs_full", "gold_f1", "recomputed", "ratio")}
        m["kl_ratio"] = m["kl"] / reuse_kl if reuse_kl > 0 else 0.0
        m["gold_f1_delta"] = None if m["gold_f1"] is None else m["gold_f1"] - out["full_prefill_gold_f1"]
        out["variants"][name] = m
    return out


def _f(value: float | None, fmt: str, width: int) -> str:
    """`value` right-aligned in `width` with `fmt` (".3f", "+.3f"); "-" when None."""
    sign, spec = ("+", fmt[1:]) if fmt.startswith("+") else ("", fmt)
    return f"{'-':>{width}}" if value is None else f"{value:>{sign}{width}{spec}}"


def print_table(summaries: list[dict], title: str) -> None:
    print(f"\n{title}")
    for s in summaries:
        print(f"\n{s['dataset']} {'~' + str(s['group_words']) + ' words' if s['group_words'] else 'one paragraph'}"
              f" per passage: n={s['n']}, {s['context_tokens']:.0f} tokens, {s['passages']:.1f} passages of"
              f" {s['passage_tokens']:.0f} tokens; full reuse KL {s['full_reuse_kl']:.3f}, reordered full prefill"
              f" top-1 {_f(s['reordered_top1'], '.2f', 4)}, full prefill gold F1 {_f(s['full_prefill_gold_f1'], '.3f', 5)}")
        print(f"  {'variant':<54} {'KL ratio':>8} {'KL':>7} {'top1':>5} {'F1 vs full':>10} {'gold dF1':>8} {'recomp':>6}")
        for name, m in s["variants"].items():
            print(f"  {name:<54} {m['kl_ratio']:>7.3f}x {m['kl']:>7.4f} {m['top1']:>5.2f} {_f(m['f1_vs_full'], '.3f', 10)}"
                  f" {_f(m['gold_f1_delta'], '+.3f', 8)} {m['recomputed']:>6.3f}")


def worst_case(summaries: list[dict]) -> dict[str, dict]:
    """Per variant, its worst cell over datasets and lengths: the highest KL ratio, the lowest top-1
    (and top-1 minus the reordered prefill's), the lowest gold F1 delta; and its mean KL ratio."""
    out: dict[str, dict] = {}
    for s in summaries:
        for name, m in s["variants"].items():
            out.setdefault(name, {"cells": []})["cells"].append((s, m))
    for w in out.values():
        cells = w.pop("cells")
        margins = [m["top1"] - s["reordered_top1"] for s, m in cells if s["reordered_top1"] is not None]
        deltas = [m["gold_f1_delta"] for _, m in cells if m["gold_f1_delta"] is not None]
        w |= {"kl_ratio": max(m["kl_ratio"] for _, m in cells),
              "mean_kl_ratio": statistics.fmean(m["kl_ratio"] for _, m in cells),
              "top1": min(m["top1"] for _, m in cells),
              "top1_margin": min(margins) if len(margins) == len(cells) else None,
              "gold_f1_delta": min(deltas) if len(deltas) == len(cells) else None,
              "recomputed": max(m["recomputed"] for _, m in cells)}
    return out


def print_worst(worst: dict[str, dict]) -> None:
    print(f"\nWorst cell per variant (over datasets and lengths)\n  {'variant':<54} {'max KL ratio':>12} {'mean':>6}"
          f" {'min top1':>8} {'min top1-reord':>14} {'min gold dF1':>12} {'max recomp':>10}")
    for name, w in sorted(worst.items(), key=lambda kv: kv[1]["kl_ratio"]):
        print(f"  {name:<54} {w['kl_ratio']:>11.3f}x {w['mean_kl_ratio']:>5.3f}x {w['top1']:>8.2f}"
              f" {_f(w['top1_margin'], '+.2f', 14)} {_f(w['gold_f1_delta'], '+.3f', 12)} {w['recomputed']:>10.3f}")
