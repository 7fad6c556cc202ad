"""Engine benchmark: `python -m blend_engine.bench [--quick]`.

Prints tables and writes JSON (benchmarks/results/engine/engine_bench.json by default):
1. Speed: median time to first token per mode at ~1K/2K/4K-token contexts of 8 real passages
   (MuSiQue dev paragraphs grouped into passages), caches warm in RAM; for blend at 0.05/0.15/0.30
   the speedup over full prefill and the fidelity of the first token (KL, top-1 agreement);
   prefix_cache measured with the passages in a different order than they were cached.
2. Quality: on MuSiQue dev questions (all 20 paragraphs as passages), token F1 of each mode's
   greedy answer against full prefill's answer, and gold F1.
3. Ablation of the selection policy (check layer, K/V/KV deviation, gradual filtering, sinks):
   mean first-token KL to full prefill and answer F1 against full prefill.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.layout import format_passage
from blend_engine.model import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig, SelectionPolicy, default_policy

logger = logging.getLogger(__name__)
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.jsonl"

_GRADUAL = ((2, 3.0), (3, 2.0), (5, 1.5), (8, 1.0))
ABLATION: dict[str, SelectionPolicy] = {
    "v@1 (LMCache-style)": SelectionPolicy(check_layer=1, metric="v"),
    "k@1": SelectionPolicy(check_layer=1, metric="k"),
    "kv@1": SelectionPolicy(check_layer=1, metric="kv"),
    "k@2": SelectionPolicy(check_layer=2, metric="k"),
    "kv@1+sink4": SelectionPolicy(check_layer=1, metric="kv", sink_tokens=4),
    "epic sink8 only": SelectionPolicy(use_deviation=False, sink_tokens=8),
    "k@1 gradual 2>1.5>1": SelectionPolicy(metric="k", check_multiplier=2.0, schedule=((2, 1.5), (3, 1.0))),
    "kv@1 gradual 4>3>2>1.5>1": SelectionPolicy(metric="kv", check_multiplier=4.0, schedule=_GRADUAL),
    "k@1 gradual 4>3>2>1.5>1": SelectionPolicy(metric="k", check_multiplier=4.0, schedule=_GRADUAL),
    "k@1 query-weighted": SelectionPolicy(metric="k", query_weighted=True),
    "kv@1 query-weighted": SelectionPolicy(metric="kv", query_weighted=True),
    "v gradual query-weighted": SelectionPolicy(metric="v", check_multiplier=4.0, schedule=_GRADUAL, query_weighted=True),
    "kv gradual query-weighted": SelectionPolicy(metric="kv", check_multiplier=4.0, schedule=_GRADUAL, query_weighted=True),
    "k gradual query-weighted (default)": default_policy(),
}


def load_questions(path: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:n]


def passages_of(row: dict) -> tuple[str, ...]:
    return tuple(format_passage(p["paragraph_text"], p["title"]) for p in row["paragraphs"])


def group_passages(rows: list[dict], n_passages: int, target_tokens: int, engine: BlendEngine) -> tuple[str, ...]:
    """n_passages passages of about target_tokens / n_passages tokens each, from consecutive paragraphs."""
    per = target_tokens // n_passages
    paras = [format_passage(p["paragraph_text"], p["title"]) for row in rows for p in row["paragraphs"]]
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


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) of two next-token distributions given as logits [V]."""
    lp, lq = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float(torch.sum(lp.exp() * (lp - lq)))


def _ttft(engine: BlendEngine, plan: BlendPlan | list[BlendPlan], repeats: int) -> tuple[float, torch.Tensor, dict]:
    """Median time to the first token; a list of plans gives one fresh plan per repeat (for orders
    the prefix cache must not have seen)."""
    plans = plan if isinstance(plan, list) else [plan] * repeats
    times, state = [], None
    for plan in plans:
        t0 = time.perf_counter()
        state = engine.prefill(plan, max_new_tokens=1)
        int(torch.argmax(state.logits))  # the first token
        times.append((time.perf_counter() - t0) * 1e3)
    rep = state.report
    return statistics.median(times), state.logits, {
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


def bench_speed(engine: BlendEngine, rows: list[dict], sizes: list[int], repeats: int) -> list[SpeedRow]:
    out: list[SpeedRow] = []
    for size in sizes:
        passages = group_passages(rows, 8, size, engine)
        question = rows[0]["question"]
        for p in passages:
            engine.ensure_cached(p)
        engine.prefill(BlendPlan(passages, question, mode="prefix_cache"))  # caches this order
        base_ms, base_logits, det = _ttft(engine, BlendPlan(passages, question, mode="full_prefill"), repeats)
        n_ctx = engine.layout(BlendPlan(passages, question)).n_tokens
        out.append(SpeedRow(size, n_ctx, "full_prefill", base_ms, 1.0, 0.0, 1.0, det))
        cases = [("prefix_cache (same order)", BlendPlan(passages, question, mode="prefix_cache")),
                 ("prefix_cache (shuffled)", [BlendPlan(passages[i:] + passages[:i], question, mode="prefix_cache")
                                              for i in range(1, repeats + 1)]),
                 ("full_reuse", BlendPlan(passages, question, mode="full_reuse"))]
        cases += [(f"blend@{r:.2f}", BlendPlan(passages, question, recompute_ratio=r)) for r in (0.05, 0.15, 0.30)]
        for name, plan in cases:
            ms, logits, det = _ttft(engine, plan, repeats)
            same_prompt = "shuffled" not in name
            out.append(SpeedRow(
                size, n_ctx, name, ms, base_ms / ms,
                kl(base_logits, logits) if same_prompt else None,
                float(torch.argmax(base_logits) == torch.argmax(logits)) if same_prompt else None, det,
            ))
            logger.info("%d tokens %-26s %.0f ms (x%.2f)", n_ctx, name, ms, base_ms / ms)
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


def bench_quality(engine: BlendEngine, rows: list[dict], policies: dict[str, tuple[str, float, SelectionPolicy | None]],
                  max_tokens: int) -> dict:
    """Per variant: mean F1 vs full prefill's answer (whole, and its first 8/16 tokens), gold F1, first-token KL.

    Greedy decoding is deterministic, so an answer's first n tokens are exactly what a run capped at
    n tokens would give: the shorter-answer agreements come from the same generations.
    """
    from benchmarks.scoring import max_over_golds, token_f1

    per: dict[str, dict[str, list[float]]] = {}
    for i, row in enumerate(rows):
        passages = passages_of(row)
        for p in passages:
            engine.ensure_cached(p)
        golds = [row["answer"], *row.get("answer_aliases", [])]
        ref, ref_logits = _answer(engine, BlendPlan(passages, row["question"], mode="full_prefill"), max_tokens)
        ref_text = {cap: _text(engine, ref, cap) for cap in (None, *ANSWER_CAPS)}  # decoded once per question
        answers = {"full_prefill": (ref, ref_logits)}
        for name, (mode, ratio, policy) in policies.items():
            plan = BlendPlan(passages, row["question"], mode=mode, recompute_ratio=ratio, policy=policy)
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and questions")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine/engine_bench.json"))
    ap.add_argument("--questions", type=int, default=None, help="quality questions (default 20, quick 8)")
    ap.add_argument("--ablation-questions", type=int, default=12)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: speed,quality,ablation")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    random.seed(0)
    skip = set(filter(None, args.skip.split(",")))
    runner = ModelRunner.load(args.model)
    engine = BlendEngine(runner, MemoryStore(8 << 30, kv_format="fp16"), EngineConfig(kv_format="fp16"))
    rows = load_questions(args.data, 60)
    result: dict = {"model": args.model, "threads": args.threads, "kv_format": "fp16", "store": "memory"}
    if "speed" not in skip:
        speed = bench_speed(engine, rows, [1000, 2000, 4000], 3 if args.quick else 5)
        _print_speed(speed)
        result["speed"] = [r.__dict__ for r in speed]
    n_q = args.questions or (8 if args.quick else 20)
    if "quality" not in skip:
        variants = {"full_reuse": ("full_reuse", None, None)}
        variants |= {f"blend@{r:.2f}": ("blend", r, None) for r in (0.05, 0.15, 0.30)}
        result["quality"] = bench_quality(engine, rows[:n_q], variants, 32)
        _print_quality(f"Answer quality on {n_q} MuSiQue dev questions (20 passages each)", result["quality"])
    if "ablation" not in skip:
        variants = {name: ("blend", 0.15, pol) for name, pol in ABLATION.items()}
        n_a = min(n_q, args.ablation_questions)
        result["ablation"] = bench_quality(engine, rows[:n_a], variants, 32)
        _print_quality(f"Selection-policy ablation at ratio 0.15 ({n_a} MuSiQue questions)", result["ablation"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
