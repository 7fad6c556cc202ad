"""The pure parts of the vLLM peer comparison: percentiles, the first-token KL, the targets, the
report's JSON and Markdown table, the plot, and an all-or-nothing file write. No servers, no torch."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BLEND = "blendserve"
VLLM = "vllm"
PAIR = "blendserve+vllm"  # Blendserve blends, a vLLM server with its KV connector decodes (issue #55)
SYSTEMS = (VLLM, BLEND, PAIR)
NEW_COMBINATION, REPEATED = "new_combination", "repeated"  # the load levels' prompts (`LoadRow.kind`)
# the RAG cases per question: (system, case); Blendserve's "ingest" is its cold blend request, whose
# missed passages are computed and stored (its kv_store_ms is the ingestion cost)
RAG_CASES = ((VLLM, "cold"), (BLEND, "cold_full_prefill"), (BLEND, "cold_blend_ingest"),
             (PAIR, "cold_full_prefill"), (PAIR, "cold_blend_ingest"),
             (VLLM, "same_order"), (BLEND, "same_order_blend"), (PAIR, "same_order_blend"),
             (BLEND, "cold_prefix_cache"), (BLEND, "same_order_prefix_cache"),
             (VLLM, "reordered"), (BLEND, "reordered_blend"), (PAIR, "reordered_blend"))


@dataclass(frozen=True)
class RagSample:
    system: str
    case: str
    dataset: str
    size: int  # the target prompt length (tokens)
    prompt_tokens: int
    ttft_ms: float  # client side: request sent -> first streamed token
    server_ttft_ms: float | None = None  # Blendserve's own timings.ttft_ms
    kv_store_ms: float | None = None  # Blendserve: storing the missed passages' KV after the answer
    cache_hits: int | None = None
    cache_misses: int | None = None
    mode: str | None = None  # the mode Blendserve served (blend may fall back to full_prefill)
    load_avg_1m: float | None = None  # the machine's 1-minute load average when the reply ended
    timings: dict[str, float] | None = None  # Blendserve's whole `timings` (retrieval, KV load, recompute, queue)


@dataclass(frozen=True)
class LoadRow:
    system: str
    clients: int
    requests: int
    answered: int
    errors: int
    seconds: float
    output_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    load_avg_1m: float | None = None  # the 1-minute load average when the level ended
    server_p50_ms: dict[str, float] | None = None  # Blendserve: p50 of each `timings` field over the level
    kind: str = NEW_COMBINATION  # known passages in a new order, or each prompt again (REPEATED)
    prefix_hit_share: float | None = None  # Blendserve: prompt tokens not computed for the prefix (pool or vLLM) / all
    longest: tuple[int, float, float] | None = None  # the longest answer: tokens, client ms to its first and last token


@dataclass(frozen=True)
class FidelityRow:
    dataset: str
    size: int
    kl_full_vs_vllm: float  # Blendserve full prefill against vLLM
    kl_blend_vs_vllm: float  # Blendserve blend (reordered passages, from the store) against vLLM
    kl_blend_vs_full: float  # Blendserve's own blend against its full prefill
    kl_reordered_blend_vs_vllm: float  # the reordered prompt: Blendserve blend against vLLM
    top1_full_agrees: bool
    top1_blend_agrees: bool


@dataclass
class Report:
    settings: dict[str, Any]
    rag: list[RagSample] = field(default_factory=list)
    load: list[LoadRow] = field(default_factory=list)
    fidelity: list[FidelityRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation); NaN for no values."""
    return float(np.percentile(list(values), q)) if len(values) else float("nan")


def _logsumexp(values: Iterable[float]) -> float:
    vals = list(values)
    top = max(vals)
    return top + math.log(sum(math.exp(v - top) for v in vals))


def merge_top(entries: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Top logprobs keyed by token text; distinct tokens with the same text are summed."""
    grouped: dict[str, list[float]] = {}
    for text, logprob in entries:
        grouped.setdefault(text, []).append(float(logprob))
    return {t: _logsumexp(v) for t, v in grouped.items()}


def kl_top(ref: Mapping[str, float], cand: Mapping[str, float], eps: float = 1e-12) -> float:
    """KL(ref || cand) over the reference's top tokens plus one bucket for the rest of the vocabulary.

    Both are maps token -> logprob (each server's top k). A reference token the candidate does not
    list gets the candidate's smallest listed logprob (an upper bound on its probability); the rest
    bucket holds each side's remaining mass. Coarsening to these buckets can only lower the KL, so a
    small value here is a necessary condition of a small full-vocabulary KL."""
    if not ref or not cand:
        raise ValueError("both distributions need at least one token")
    floor = min(cand.values())
    p = [math.exp(lp) for lp in ref.values()]
    q = [math.exp(cand.get(tok, floor)) for tok in ref]
    p_rest, q_rest = max(1.0 - sum(p), eps), max(1.0 - sum(q), eps)
    kl = sum(pi * math.log(pi / max(qi, eps)) for pi, qi in zip(p, q) if pi > 0)
    return max(0.0, kl + p_rest * math.log(p_rest / q_rest))


def top1(dist: Mapping[str, float]) -> str:
    return max(dist, key=dist.__getitem__)


# ----------------------------------------------------------------------------- summaries


def ttft_summary(samples: Sequence[RagSample]) -> list[dict[str, Any]]:
    """TTFT p50/p95 per (system, case, size), in RAG_CASES order, then by size."""
    order = {sc: i for i, sc in enumerate(RAG_CASES)}
    groups: dict[tuple[str, str, int], list[RagSample]] = {}
    for s in samples:
        groups.setdefault((s.system, s.case, s.size), []).append(s)
    rows = []
    for (system, case, size), group in sorted(groups.items(), key=lambda kv: (kv[0][2], order.get(kv[0][:2], 99))):
        ttft = [s.ttft_ms for s in group]
        store = [s.kv_store_ms for s in group if s.kv_store_ms is not None]
        loads = [s.load_avg_1m for s in group if s.load_avg_1m is not None]
        rows.append({"system": system, "case": case, "size": size, "n": len(group),
                     "prompt_tokens": int(np.mean([s.prompt_tokens for s in group])),
                     "ttft_p50_ms": percentile(ttft, 50), "ttft_p95_ms": percentile(ttft, 95),
                     "kv_store_p50_ms": percentile(store, 50) if store else None,
                     "load_avg_1m": f"{min(loads):.1f}-{max(loads):.1f}" if loads else None})
    return rows


def _p50(summary: Sequence[Mapping[str, Any]], system: str, case: str, size: int) -> float | None:
    for row in summary:
        if (row["system"], row["case"], row["size"]) == (system, case, size):
            return row["ttft_p50_ms"]
    return None


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0 or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def targets(report: Report) -> list[dict[str, Any]]:
    """Issue #37's targets, each with its measured value and whether it is met (None: not measured)."""
    summary = ttft_summary(report.rag)
    sizes = sorted({s.size for s in report.rag})
    out = []
    for size in sizes:
        speedup = _ratio(_p50(summary, VLLM, "reordered", size), _p50(summary, BLEND, "reordered_blend", size))
        out.append(_target(f"reordered @{size}: vLLM / Blendserve blend TTFT", speedup, ">=", 3.0))
        repeat = _ratio(_p50(summary, BLEND, "same_order_blend", size), _p50(summary, VLLM, "same_order", size))
        out.append(_target(f"same order @{size}: Blendserve blend / vLLM prefix hit TTFT", repeat, "<=", 1.5))
        cold = _ratio(_p50(summary, BLEND, "cold_full_prefill", size), _p50(summary, VLLM, "cold", size))
        out.append(_target(f"cold @{size}: Blendserve full prefill / vLLM TTFT", cold, "<=", 1.0))
    for clients in sorted({r.clients for r in report.load}):
        share = _share(report.load, BLEND, clients, NEW_COMBINATION)
        if clients >= 8:
            out.append(_target(f"{clients} clients: Blendserve / vLLM tokens/s", share, ">=", 0.8))
    out += pair_targets(report, summary, sizes)
    if report.fidelity:
        worst = max(r.kl_full_vs_vllm for r in report.fidelity)
        out.append(_target("full-prefill first-token KL vs vLLM (max)", worst, "<", 0.01))
    return out


def pair_targets(report: Report, summary: Sequence[Mapping[str, Any]], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Issue #55's targets for Blendserve + vLLM against vLLM alone (none when the pair did not run)."""
    if not any(s.system == PAIR for s in report.rag) and not any(r.system == PAIR for r in report.load):
        return []
    out = []
    for size in sizes:
        speedup = _ratio(_p50(summary, VLLM, "reordered", size), _p50(summary, PAIR, "reordered_blend", size))
        out.append(_target(f"reordered @{size}: vLLM / Blendserve+vLLM TTFT", speedup, ">=", 3.0))
        repeat = _ratio(_p50(summary, PAIR, "same_order_blend", size), _p50(summary, VLLM, "same_order", size))
        out.append(_target(f"same prompt again @{size}: Blendserve+vLLM / vLLM TTFT", repeat, "<=", 1.2))
    for clients in sorted({r.clients for r in report.load if r.system == PAIR}):
        out.append(_target(f"{clients} clients, repeated prompts: Blendserve+vLLM / vLLM tokens/s",
                           _share(report.load, PAIR, clients, REPEATED), ">=", 0.9))
        if clients == 8:
            out.append(_target("8 clients, new combinations: Blendserve+vLLM / vLLM tokens/s",
                               _share(report.load, PAIR, clients, NEW_COMBINATION), ">=", 1.5))
    return out


def _share(rows: Sequence[LoadRow], system: str, clients: int, kind: str) -> float | None:
    """`system`'s tokens/s over vLLM's at one level and kind."""
    def rate(name: str) -> float | None:
        found = [r.tokens_per_s for r in rows if (r.system, r.clients, r.kind) == (name, clients, kind)]
        return found[0] if found else None
    return _ratio(rate(system), rate(VLLM))


def _target(name: str, value: float | None, op: str, goal: float) -> dict[str, Any]:
    met = None if value is None else {">=": value >= goal, "<=": value <= goal, "<": value < goal}[op]
    return {"target": name, "value": value, "goal": f"{op} {goal:g}", "met": met}


def to_json(report: Report) -> dict[str, Any]:
    return {"settings": report.settings, "notes": report.notes, "targets": targets(report),
            "rag_summary": ttft_summary(report.rag), "rag": [asdict(s) for s in report.rag],
            "load": [asdict(r) for r in report.load], "fidelity": [asdict(r) for r in report.fidelity]}


# ----------------------------------------------------------------------------- Markdown


def _ms(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.0f}"


def rag_table(summary: Sequence[Mapping[str, Any]]) -> str:
    head = ("| prompt | system | case | n | tokens | TTFT p50 / p95 (ms) | KV store p50 (ms) | load 1m |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| ~{r['size']} | {r['system']} | {r['case']} | {r['n']} | {r['prompt_tokens']} | "
        f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p95_ms'])} | {_ms(r['kv_store_p50_ms'])} | "
        f"{r.get('load_avg_1m') or '-'} |\n" for r in summary)


def load_table(rows: Sequence[LoadRow]) -> str:
    head = ("| prompts | clients | system | answered / requests | output tok/s | TTFT p50 / p95 (ms) | load 1m "
            "| longest answer: tokens, first / last token (ms) | prefix-hit share | Blendserve timings p50 (ms) |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(f"| {r.kind} | {r.clients} | {r.system} | {r.answered} / {r.requests} | "
                          f"{r.tokens_per_s:.1f} | {_ms(r.ttft_p50_ms)} / {_ms(r.ttft_p95_ms)} | {_num(r.load_avg_1m)} | "
                          f"{_longest(r.longest)} | {_percent(r.prefix_hit_share)} | {_timings(r.server_p50_ms)} |\n"
                          for r in sorted(rows, key=lambda r: (r.kind, r.clients, r.system)))


def _longest(x: tuple[int, float, float] | None) -> str:
    return "-" if x is None else f"{x[0]}, {_ms(x[1])} / {_ms(x[2])}"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _timings(t: Mapping[str, float] | None) -> str:
    return "-" if not t else ", ".join(f"{k.removesuffix('_ms')} {v:,.0f}" for k, v in t.items())


def fidelity_table(rows: Sequence[FidelityRow]) -> str:
    head = ("| dataset | prompt | KL full vs vLLM | KL blend vs vLLM | KL blend vs full | KL reordered blend vs vLLM "
            "| top-1 full / blend = vLLM |\n|---|---|---|---|---|---|---|\n")
    return head + "".join(f"| {r.dataset} | ~{r.size} | {r.kl_full_vs_vllm:.4f} | {r.kl_blend_vs_vllm:.4f} | "
                          f"{r.kl_blend_vs_full:.4f} | {r.kl_reordered_blend_vs_vllm:.4f} | "
                          f"{'yes' if r.top1_full_agrees else 'no'} / "
                          f"{'yes' if r.top1_blend_agrees else 'no'} |\n" for r in rows)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _met(m: bool | None) -> str:
    return "-" if m is None else ("yes" if m else "no")


def targets_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = "| target | measured | goal | met |\n|---|---|---|---|\n"
    return head + "".join(f"| {t['target']} | {_num(t['value'])} | {t['goal']} | {_met(t['met'])} |\n" for t in rows)


def markdown(report: Report) -> str:
    parts = ["## Settings\n\n```\n" + json.dumps(report.settings, indent=1) + "\n```\n",
             "## RAG first tokens\n\n" + rag_table(ttft_summary(report.rag)),
             "## Under load\n\n" + load_table(report.load),
             "## Fidelity (first token, top-20 logprobs)\n\n" + fidelity_table(report.fidelity),
             "## Targets\n\n" + targets_table(targets(report))]
    if report.notes:
        parts.append("## Notes\n\n" + "".join(f"- {n}\n" for n in report.notes))
    return "\n".join(parts)


# ----------------------------------------------------------------------------- files


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_png(report: Report) -> bytes:
    """TTFT p50 per case and size (left), output tokens/s per client count (right), as PNG bytes."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = ttft_summary(report.rag)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for system, case in RAG_CASES:
        sel = [r for r in summary if (r["system"], r["case"]) == (system, case)]
        if sel:
            left.plot([r["size"] for r in sel], [r["ttft_p50_ms"] / 1e3 for r in sel], marker="o",
                      linestyle={BLEND: "-", PAIR: ":"}.get(system, "--"), label=f"{system} {case}")
    left.set(xlabel="prompt tokens (target)", ylabel="TTFT p50 (s)", yscale="log", title="RAG first tokens")
    left.legend(fontsize=7)
    for system in SYSTEMS:
        for kind in (NEW_COMBINATION, REPEATED):
            sel = sorted((r for r in report.load if (r.system, r.kind) == (system, kind)), key=lambda r: r.clients)
            if sel:
                right.plot([r.clients for r in sel], [r.tokens_per_s for r in sel], marker="o",
                           linestyle="-" if kind == NEW_COMBINATION else "--", label=f"{system} {kind}")
    right.set(xlabel="concurrent clients", ylabel="output tokens/s", title="under load")
    right.set_xscale("log", base=2)
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_results(report: Report, out_dir: Path, stem: str) -> list[Path]:
    """JSON, Markdown and PNG, each written whole; all are rendered before the first is written."""
    files = {out_dir / f"{stem}.json": json.dumps(to_json(report), indent=1),
             out_dir / f"{stem}.md": markdown(report),
             out_dir / f"{stem}.png": plot_png(report)}
    for path, data in files.items():
        write_atomic(path, data)
    return list(files)

