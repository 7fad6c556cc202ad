"""Engine benchmark: `python -m benchmarks.ttft.engine [--quick]` (`make bench-engine`).

Prints tables and writes JSON (benchmarks/results/engine/engine_bench.json by default):
1. Speed: median time to first token per mode at ~1K/2K/4K-token contexts of 8 real passages
   (dev paragraphs grouped into passages), caches warm in RAM; for blend at 0.05/0.15/0.30
   the speedup over full prefill and the fidelity of the first token (KL, top-1 agreement);
   prefix_cache measured with the passages in a different order than they were cached.
2. Quality: on MuSiQue dev questions by default (`--data` takes a MuSiQue or HotpotQA dev file;
   all of a question's paragraphs as passages), token F1 of each mode's
   greedy answer against full prefill's answer, and gold F1.
3. Ablation of the selection policy (check layer, K/V/KV deviation, gradual filtering, sinks):
   mean first-token KL to full prefill and answer F1 against full prefill.
`--group-words N` lays the quality and ablation parts' paragraphs out as ~N-word passages (the
grouping of `benchmarks.run --group-words`).
4. With `--lengths 0,200,400,600`: the length sweep of `benchmarks.quality.lengths` (both dev sets, each
   passage length, the issue-#28 selection options; worst case per option over the cells), and the
   oracle bound (`benchmarks.quality.oracle`: variants "oracle-select@R", "oracle-fix@R"); `--sweep-misses`
   lists the questions whose top-1 differs from full prefill's, and by how much.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common.data import HOTPOTQA_FILE, MUSIQUE_FILE, Example, default_data_dir, passages_of, read_examples
from benchmarks.common.policies import PREVIOUS_DEFAULT, plain
from benchmarks.common.scoring import kl, max_over_golds, token_f1
from benchmarks.quality import lengths as length_sweep
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig, SelectionPolicy
from retrieval.text import format_passage

logger = logging.getLogger(__name__)

_GRADUAL = ((2, 3.0), (3, 2.0), (5, 1.5), (8, 1.0))
ABLATION: dict[str, SelectionPolicy] = {
    "v@1 (LMCache-style)": plain(check_layer=1, metric="v"),
    "k@1": plain(check_layer=1, metric="k"),
    "kv@1": plain(check_layer=1, metric="kv"),
    "k@2": plain(check_layer=2, metric="k"),
    "kv@1+sink4": plain(check_layer=1, metric="kv", sink_tokens=4),
    "epic sink8 only": plain(use_deviation=False, sink_tokens=8),
    "k@1 gradual 2>1.5>1": plain(metric="k", check_multiplier=2.0, schedule=((2, 1.5), (3, 1.0))),
    "kv@1 gradual 4>3>2>1.5>1": plain(metric="kv", check_multiplier=4.0, schedule=_GRADUAL),
    "k@1 gradual 4>3>2>1.5>1": plain(metric="k", check_multiplier=4.0, schedule=_GRADUAL),
    "k@1 query-weighted": plain(metric="k", query_weighted=True),
    "kv@1 query-weighted": plain(metric="kv", query_weighted=True),
    "v gradual query-weighted": plain(metric="v", check_multiplier=4.0, schedule=_GRADUAL, query_weighted=True),
    "kv gradual query-weighted": plain(metric="kv", check_multiplier=4.0, schedule=_GRADUAL, query_weighted=True),
    "k gradual 4x > 3x > 2x > 1.5x > 1x by layer 8, query-weighted (default until the 4-layer one)": plain(
        metric="k", check_multiplier=4.0, schedule=_GRADUAL, query_weighted=True),
    "k gradual 4x > 2x > 1.5x > 1x by layer 4, query-weighted (previous default)": PREVIOUS_DEFAULT,
    "k gradual 4x > 2x > 1.5x > 1x by layer 4, query-weighted, sinks 8": plain(
        metric="k", check_multiplier=4.0, schedule=((2, 2.0), (3, 1.5), (4, 1.0)), sink_tokens=8, query_weighted=True),
    "k@2 gradual 4x > 2x > 1.5x > 1x by layer 5, query-weighted, sinks 8": plain(
        check_layer=2, metric="k", check_multiplier=4.0, schedule=((3, 2.0), (4, 1.5), (5, 1.0)), sink_tokens=8,
        query_weighted=True),
    "k gradual 4x > 2x > 1x by layer 4, query-weighted": plain(
        metric="k", check_multiplier=4.0, schedule=((2, 2.0), (4, 1.0)), query_weighted=True),
}
ABLATION |= {f"default + {name}": pol for name, pol in length_sweep.policy_options().items()}  # issue #28's


def pick_variants(spec: str) -> dict[str, SelectionPolicy]:
    """Ablation variants whose names contain one of the comma-separated parts of `spec` ("" = all)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    chosen = {n: pol for n, pol in ABLATION.items() if not parts or any(p in n for p in parts)}
    if not chosen:
        raise SystemExit(f"no ablation variant matches {spec!r}; names: {', '.join(ABLATION)}")
    return chosen


def load_questions(path: Path, n: int) -> list[Example]:
    """The first n questions of a MuSiQue or HotpotQA dev file; a clear exit for a missing or foreign file."""
    try:
        return read_examples(path, n)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"cannot read questions from {path}: {e}") from e


def group_passages(rows: list[Example], n_passages: int, target_tokens: int, engine: BlendEngine) -> tuple[str, ...]:
    """n_passages passages of about target_tokens / n_passages tokens each, from consecutive paragraphs."""
    per = target_tokens // n_passages
    paras = [format_passage(p.text, p.title) for row in rows for p in row.paragraphs]
    out, cur, cur_len = [], [], 0
    for para in paras:
        n = len(engine.passage_tokens(para))
        if cur and abs(cur_len + n - per) > abs(cur_len - per):  # adding it would move away from the share
            out.append("\n".join(cur))
            cur, cur_len = [], 0
            if len(out) == n_passages:
                break
        cur.append(para)
        cur_len += n
    if len(out) < n_passages:
        raise ValueError(f"not enough paragraphs for {n_passages} passages of {per} tokens")
    return tuple(out)


def _first_token(engine: BlendEngine, plan: BlendPlan) -> tuple[float, torch.Tensor, dict]:
    """Time to the first token of one request through the engine loop (ms), its logits [V] and the
    report's detail. The engine's automatic prefix caching is off, so only prefix_cache mode takes a
    cached prefix from the KV pool (what an earlier prefix_cache or full prefill request left there)."""
    t0 = time.perf_counter()
    gen = engine.generate(plan, GenerationConfig(max_tokens=1))
    for _ in gen:
        pass
    ms = (time.perf_counter() - t0) * 1e3
    state = gen.state
    rep = state.report
    return ms, state.logits, {
        "recomputed_tokens": rep.recomputed_tokens, "load_ms": rep.load_ms, "recompute_ms": rep.recompute_ms,
        "assemble_ms": rep.assemble_ms, "prefix_tokens_reused": rep.prefix_tokens_reused,
    }


@dataclass
class SpeedRow:
    target_tokens: int
    context_tokens: int
    mode: str
    ttft_ms: float
    speedup: float
    kl: float | None
    top1_agree: float | None
    detail: dict


def _speed_cases(passages: tuple[str, ...], question: str,
                 policies: dict[str, SelectionPolicy]) -> list[tuple[str, Callable[[int], BlendPlan]]]:
    """(mode name, plan for repeat i); prefix_cache (shuffled) gets a rotation it has not cached yet;
    `policies` adds blend@0.15 under other selection policies."""
    def plan(mode: str, ratio: float | None = None, policy: SelectionPolicy | None = None) -> Callable[[int], BlendPlan]:
        return lambda i: BlendPlan(passages, question, mode=mode, recompute_ratio=ratio, policy=policy)

    def rotated(i: int) -> BlendPlan:
        k = i % (len(passages) - 1) + 1
        return BlendPlan(passages[k:] + passages[:k], question, mode="prefix_cache")

    cases = [("full_prefill", plan("full_prefill")), ("prefix_cache (same order)", plan("prefix_cache")),
             ("prefix_cache (shuffled)", rotated), ("full_reuse", plan("full_reuse"))]
    cases += [(f"blend@{r:.2f}", plan("blend", r)) for r in (0.05, 0.15, 0.30)]
    return cases + [(f"blend@0.15 {name}", plan("blend", 0.15, pol)) for name, pol in policies.items()]


def bench_speed(engine: BlendEngine, rows: list[Example], sizes: list[int], repeats: int,
                policies: dict[str, SelectionPolicy] | None = None) -> list[SpeedRow]:
    """Repeats are interleaved (full prefill, then every mode, then again), so a slow spell of a
    shared host hits all modes alike; a speedup is the median of the per-repeat ratios."""
    out: list[SpeedRow] = []
    for size in sizes:
        passages = group_passages(rows, 8, size, engine)
        question = rows[0].question
        for p in passages:
            engine.ensure_cached(p)
        _first_token(engine, BlendPlan(passages, question, mode="prefix_cache"))  # this order in the pool
        n_ctx = engine.layout(BlendPlan(passages, question)).n_tokens
        cases = _speed_cases(passages, question, policies or {})
        runs: dict[str, list[tuple[float, torch.Tensor, dict]]] = {name: [] for name, _ in cases}
        for i in range(repeats):
            for name, plan_of in cases:
                runs[name].append(_first_token(engine, plan_of(i)))
        base = runs["full_prefill"]
        for name, _ in cases:
            ms = statistics.median(r[0] for r in runs[name])
            speedup = statistics.median(b[0] / r[0] for b, r in zip(base, runs[name]))
            logits, det = runs[name][-1][1], runs[name][-1][2]
            same_prompt = "shuffled" not in name
            out.append(SpeedRow(
                size, n_ctx, name, ms, speedup,
                kl(base[-1][1], logits) if same_prompt else None,
                float(torch.argmax(base[-1][1]) == torch.argmax(logits)) if same_prompt else None, det,
            ))
            logger.info("%d tokens %-26s %.0f ms (x%.2f)", n_ctx, name, ms, speedup)
    return out


def _answer(engine: BlendEngine, plan: BlendPlan, max_tokens: int) -> tuple[tuple[int, ...], torch.Tensor]:
    """Greedy answer token ids (stops at a newline) and the first-token logits [V]."""
    gen = engine.generate(plan, GenerationConfig(max_tokens=max_tokens, stop=("\n",)))
    for _ in gen:
        pass
    return gen.result.token_ids, gen.state.logits


ANSWER_CAPS = (8, 16)  # agreement is also scored on the answers' first 8 and 16 tokens


def _text(engine: BlendEngine, ids: tuple[int, ...], cap: int | None = None) -> str:
    return engine.runner.decode(list(ids[:cap])).split("\n")[0].strip()


def bench_quality(engine: BlendEngine, rows: list[Example], policies: dict[str, tuple[str, float, SelectionPolicy | None]],
                  max_tokens: int, group_words: int | None = None) -> dict:
    """Per variant: mean F1 vs full prefill's answer (whole, and its first 8/16 tokens), gold F1, first-token KL.

    Greedy decoding is deterministic, so an answer's first n tokens are exactly what a run capped at
    n tokens would give: the shorter-answer agreements come from the same generations.
    """
    per: dict[str, dict[str, list[float]]] = {}
    for i, row in enumerate(rows):
        passages = passages_of(row, group_words=group_words)
        for p in passages:
            engine.ensure_cached(p)
        golds = list(row.answers)
        ref, ref_logits = _answer(engine, BlendPlan(passages, row.question, mode="full_prefill"), max_tokens)
        ref_text = {cap: _text(engine, ref, cap) for cap in (None, *ANSWER_CAPS)}  # decoded once per question
        answers = {"full_prefill": (ref, ref_logits)}
        for name, (mode, ratio, policy) in policies.items():
            plan = BlendPlan(passages, row.question, mode=mode, recompute_ratio=ratio, policy=policy)
            answers[name] = _answer(engine, plan, max_tokens)
        for name, (ids, logits) in answers.items():
            acc = per.setdefault(name, {})
            text = _text(engine, ids)
            acc.setdefault("f1_vs_full", []).append(token_f1(text, ref_text[None]))
            for cap in ANSWER_CAPS:
                acc.setdefault(f"f1_vs_full@{cap}", []).append(token_f1(_text(engine, ids, cap), ref_text[cap]))
            acc.setdefault("gold_f1", []).append(max_over_golds(token_f1, text, golds))
            acc.setdefault("kl", []).append(kl(ref_logits, logits))
            acc.setdefault("answer_tokens", []).append(float(len(ids)))
        logger.info("quality %d/%d done", i + 1, len(rows))
    return {name: {k: statistics.fmean(v) for k, v in acc.items()} | {"n": len(acc["kl"])} for name, acc in per.items()}


def _print_speed(rows: list[SpeedRow]) -> None:
    print(f"{'ctx':>6} {'mode':<26} {'TTFT ms':>9} {'speedup':>8} {'KL':>7} {'top1':>5}")
    for r in rows:
        kl_s = "-" if r.kl is None else f"{r.kl:.3f}"
        t1 = "-" if r.top1_agree is None else f"{r.top1_agree:.0f}"
        print(f"{r.context_tokens:>6} {r.mode:<26} {r.ttft_ms:>9.1f} {r.speedup:>8.2f} {kl_s:>7} {t1:>5}")


def _print_quality(title: str, table: dict) -> None:
    caps = "".join(f" {'@' + str(c):>6}" for c in ANSWER_CAPS)
    print(f"\n{title}\n{'variant':<36} {'F1 vs full':>10}{caps} {'gold F1':>8} {'KL':>7} {'n':>4}")
    for name, m in table.items():
        at = "".join(f" {m[f'f1_vs_full@{c}']:>6.3f}" for c in ANSWER_CAPS)
        print(f"{name:<36} {m['f1_vs_full']:>10.3f}{at} {m['gold_f1']:>8.3f} {m['kl']:>7.3f} {m['n']:>4}")


def _ratios(spec: str) -> list[float]:
    try:
        ratios = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--ratios must be a comma list of numbers, not {spec!r}") from None
    if not ratios or any(not 0 <= r <= 1 for r in ratios):
        raise SystemExit(f"--ratios must list ratios within [0, 1], not {spec!r}")
    return ratios


def _layout_name(group_words: int | None) -> str:
    return f"paragraphs grouped into ~{group_words}-word passages" if group_words else "all paragraphs as passages"


def _sweep_rows(args: argparse.Namespace) -> dict[str, list[Example]]:
    """Per dataset, the questions of the chosen half (2 x --sweep-questions are read)."""
    files = {"musique": MUSIQUE_FILE, "hotpotqa": HOTPOTQA_FILE}
    n = args.sweep_questions
    lo, hi = {"tune": (0, n), "report": (n, 2 * n), "both": (0, 2 * n)}[args.sweep_half]
    out = {}
    for name in filter(None, (d.strip() for d in args.sweep_datasets.split(","))):
        if name not in files:
            raise SystemExit(f"--sweep-datasets: unknown dataset {name!r}; expected musique, hotpotqa")
        out[name] = load_questions(default_data_dir() / files[name], 2 * n)[lo:hi][:args.sweep_limit]
    return out


def _sweep_variants(spec: str) -> dict[str, length_sweep.Variant]:
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    chosen = {n: v for n, v in length_sweep.SWEEP.items() if not parts or any(p in n for p in parts)}
    if not chosen:
        raise SystemExit(f"no sweep variant matches {spec!r}; names: {', '.join(length_sweep.SWEEP)}")
    return chosen


def run_sweep(engine: BlendEngine | None, args: argparse.Namespace, rows: dict[str, list[Example]], lengths: list[int],
              variants: dict[str, length_sweep.Variant]) -> dict:
    """The length sweep (`benchmarks.quality.lengths`): per-cell tables and each variant's worst cell."""
    cells = length_sweep.sweep(None if args.sweep_cached_only else engine, args.model, rows, lengths, variants, args.ref_cache,
                               answers=not args.sweep_first_token)
    summaries = [length_sweep.summarize(c) for c in cells]
    worst = length_sweep.worst_case(summaries)
    length_sweep.print_table(summaries, f"Length sweep, {args.sweep_half} half ({args.sweep_questions} questions a half)")
    length_sweep.print_worst(worst)
    out = {"half": args.sweep_half, "questions_per_half": args.sweep_questions, "limit": args.sweep_limit,
           "first_token_only": args.sweep_first_token, "cells": summaries, "worst": worst}
    if args.sweep_misses:
        out["top1_misses"] = length_sweep.explain_misses(engine, args.model, rows, lengths, variants, args.ref_cache)
        length_sweep.print_misses(out["top1_misses"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and questions")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data", type=Path, default=None,
                    help=f"a MuSiQue or HotpotQA dev .jsonl file (default: {MUSIQUE_FILE} in the shared data dir)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine/engine_bench.json"))
    ap.add_argument("--questions", type=int, default=None, help="quality questions (default 20, quick 8)")
    ap.add_argument("--ablation-questions", type=int, default=None, help="default 12, quick 8")
    ap.add_argument("--ablation-offset", type=int, default=0, help="first question of the ablation (held-out runs)")
    ap.add_argument("--ablation-variants", default="", help="comma list of name parts to run (default: all)")
    ap.add_argument("--speed-variants", default=None,
                    help="comma list of ablation name parts also timed as blend@0.15 in the speed part")
    ap.add_argument("--sizes", default="1000,2000,4000", help="target context tokens of the speed part")
    ap.add_argument("--ratios", default="0.05,0.15,0.30", help="blend ratios of the quality part")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: speed,quality,ablation")
    ap.add_argument("--group-words", type=int, default=None,
                    help="quality and ablation parts: group paragraphs into passages of ~N words")
    ap.add_argument("--lengths", default="",
                    help="length sweep: comma list of passage lengths in words (0 = one paragraph), e.g. 0,200,400,600")
    ap.add_argument("--sweep-datasets", default="musique,hotpotqa", help="length sweep: datasets")
    ap.add_argument("--sweep-questions", type=int, default=12, help="length sweep: questions per half")
    ap.add_argument("--sweep-half", choices=("tune", "report", "both"), default="tune",
                    help="length sweep: the first half (tune), the second (report) or both")
    ap.add_argument("--sweep-limit", type=int, default=None, help="length sweep: only the first N questions of the half")
    ap.add_argument("--sweep-first-token", action="store_true",
                    help="length sweep: first-token scores only (KL, top-1; no answers, no reordered prefill)")
    ap.add_argument("--sweep-cached-only", action="store_true",
                    help="length sweep: tables from --ref-cache alone (no model); a cell counts the questions"
                         " whose reference and every variant are cached")
    ap.add_argument("--sweep-misses", action="store_true",
                    help="length sweep: list the questions whose top-1 differs from full prefill's, with full prefill's"
                         " top-2 gap and the other top-1's rank there (recomputed for runs cached without it, also"
                         " with --sweep-cached-only, which then loads the model for them alone)")
    ap.add_argument("--sweep-variants", default="", help="length sweep: comma list of variant name parts (default all)")
    ap.add_argument("--ref-cache", type=Path, default=Path.home() / ".cache/blendserve/length_sweep.json",
                    help="length sweep: per-question references and results, re-used across runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--store-mb", type=int, default=8192,
                    help="the RAM KV store's budget (LRU); the length sweep re-uses a question's passages only while"
                         " on it, so 1024 is plenty there and keeps a long sweep's memory at ~2.5 GB")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    random.seed(0)
    skip = set(filter(None, args.skip.split(",")))
    ratios = _ratios(args.ratios)  # before the model: a bad list fails fast
    n_q = args.questions or (8 if args.quick else 20)
    n_a, first = args.ablation_questions or (8 if args.quick else 12), args.ablation_offset
    args.data = args.data or default_data_dir() / MUSIQUE_FILE
    rows = load_questions(args.data, max(60, n_q, first + n_a))  # before the model: a bad file fails fast
    sweep_lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    sweep_rows = _sweep_rows(args) if sweep_lengths else {}
    sweep_variants = _sweep_variants(args.sweep_variants) if sweep_lengths else {}
    if not rows:
        raise SystemExit(f"{args.data} holds no questions")
    if sweep_lengths and args.sweep_cached_only and not args.sweep_misses:  # tables from the cache alone: no model
        result = {"model": args.model, "length_sweep": run_sweep(None, args, sweep_rows, sweep_lengths, sweep_variants)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")
        return
    runner = ModelRunner.load(args.model)
    engine = BlendEngine(runner, MemoryStore(args.store_mb << 20, kv_format="fp16"),
                         EngineConfig(kv_format="fp16", prefix_caching=False))
    result: dict = {"model": args.model, "data": args.data.name, "threads": args.threads, "kv_format": "fp16",
                    "store": "memory"}
    if "speed" not in skip:
        extra = pick_variants(args.speed_variants) if args.speed_variants else {}
        sizes = [int(x) for x in args.sizes.split(",")]
        result["repeats"] = 3 if args.quick else 5
        speed = bench_speed(engine, rows, sizes, result["repeats"], extra)
        _print_speed(speed)
        result["speed"] = [r.__dict__ for r in speed]
    if "quality" not in skip:
        variants = {"full_reuse": ("full_reuse", None, None)}
        variants |= {f"blend@{r:.2f}": ("blend", r, None) for r in ratios}
        result["quality"] = bench_quality(engine, rows[:n_q], variants, 32, args.group_words)
        _print_quality(f"Answer quality on {n_q} {args.data.name} questions ({_layout_name(args.group_words)})",
                       result["quality"])
    if "ablation" not in skip:
        variants = {"full_reuse": ("full_reuse", None, None)}
        variants |= {name: ("blend", 0.15, pol) for name, pol in pick_variants(args.ablation_variants).items()}
        result["ablation_questions"] = [first, first + n_a]
        result["ablation"] = bench_quality(engine, rows[first:first + n_a], variants, 32, args.group_words)
        _print_quality(f"Selection-policy ablation at ratio 0.15 ({args.data.name} questions {first}..{first + n_a - 1})",
                       result["ablation"])
    if sweep_lengths:
        result["length_sweep"] = run_sweep(engine, args, sweep_rows, sweep_lengths, sweep_variants)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
