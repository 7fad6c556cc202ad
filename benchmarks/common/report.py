"""Markdown rendering of the benchmark results, and the README section that shows the latest run."""

from __future__ import annotations

import re
from pathlib import Path

README_START = "<!-- bench-results:start -->"
README_END = "<!-- bench-results:end -->"


def _ci(m: dict, digits: int = 3) -> str:
    return f"{m['mean']:.{digits}f} [{m['low']:.{digits}f}, {m['high']:.{digits}f}]"


def quality_table(summary: dict) -> str:
    lines = []
    for ds, modes in summary["table"].items():
        n = next(iter(modes.values()))["n"]
        lines += [f"**{ds}** (n={n}; mean [95% bootstrap CI])", "",
                  "| mode | F1 | EM | agreement F1 vs full prefill | first-token KL | recomputed share | TTFT ms |",
                  "|---|---|---|---|---|---|---|"]
        for name, m in modes.items():
            lines.append(f"| {name} | {_ci(m['f1'])} | {m['em']['mean']:.3f} | {_ci(m['agreement_f1'])} | "
                         f"{_ci(m['kl'])} | {m['recompute_share']['mean']:.3f} | {m['ttft_ms']['mean']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def paired_table(summary: dict) -> str:
    lines = ["| data | difference | mean | 95% CI |", "|---|---|---|---|"]
    for ds, diffs in summary["paired"].items():
        for name, d in diffs.items():
            lines.append(f"| {ds} | {name} | {d['mean']:+.3f} | [{d['low']:+.3f}, {d['high']:+.3f}] |")
    return "\n".join(lines)


def goals_table(summary: dict) -> str:
    lines = ["| goal | value |", "|---|---|"]
    for k, v in summary.get("goals", {}).items():
        lines.append(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    return "\n".join(lines)


def perf_table(rows: list[dict]) -> str:
    lines = ["| target tokens | context tokens | tier | mode | TTFT ms | KV load ms | speedup vs full prefill |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target_tokens']} | {r['context_tokens']} | {r['tier']} | {r['mode']} | {r['ttft_ms']:.0f} | "
                     f"{r['load_ms']:.0f} | {r['speedup_vs_full_prefill']:.2f}x |")
    return "\n".join(lines)


def throughput_table(rows: list[dict]) -> str:
    lines = ["| mode | clients | requests | errors | req/s | p50 ms | p99 ms | mean context tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['clients']} | {r['requests']} | {r['errors']} | {r['rps']:.3f} | "
                     f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['mean_context_tokens']:.0f} |")
    by = {r["mode"]: r["rps"] for r in rows}
    if by.get("full_prefill"):
        lines += ["", f"Throughput ratio blend / full prefill: **{by.get('blend', 0) / by['full_prefill']:.2f}x** "
                      "(goal >= 2.8x)."]
    return "\n".join(lines)


def peer_table(rows: list[dict], perf_rows: list[dict]) -> str:
    ours = {(r["target_tokens"], r["mode"]): r["ttft_ms"] for r in perf_rows if r["tier"] in ("-", "ram")}
    lines = ["| target tokens | context tokens | llama.cpp case | llama.cpp TTFT ms | ours full_prefill ms "
             "| ours blend@0.15 ms |", "|---|---|---|---|---|---|"]
    for r in rows:
        t = r["target_tokens"]
        lines.append(f"| {t} | {r['context_tokens']} | {r['case']} | {r['ttft_ms']:.0f} | "
                     f"{ours.get((t, 'full_prefill'), float('nan')):.0f} | {ours.get((t, 'blend@0.15'), float('nan')):.0f} |")
    return "\n".join(lines)


def render(results: dict) -> str:
    meta = results["meta"]
    out = ["# Blendserve benchmark results", "",
           f"Command: `{meta['command']}`  ", f"Date: {meta['date']}, {meta['elapsed_s']:.0f} s.  ",
           f"Machine: {meta['machine']}  ", f"Model: {meta['model']}.  ",
           f"Examples: {meta['examples']}; passages per example: {meta['passage_layout']}.", ""]
    if results.get("quality"):
        q = results["quality"]
        out += ["## Quality", "", quality_table(q), "### Paired differences (bootstrap of the per-example difference)", "",
                paired_table(q), "", "### Goals (pooled)", "", goals_table(q), "", "![F1 vs ratio](f1_vs_ratio.png)", ""]
    if results.get("perf"):
        out += ["## TTFT per mode and context length", "", perf_table(results["perf"]), "",
                "![TTFT vs context](ttft_vs_context.png)", ""]
    if results.get("throughput"):
        out += ["## Service throughput", "", throughput_table(results["throughput"]), ""]
    out += ["## llama.cpp peer", ""]
    out += [peer_table(results["peer"], results.get("perf", []))] if results.get("peer") else [results.get("peer_note", "")]
    for note in meta.get("notes", []):
        out += ["", f"> {note}"]
    return "\n".join(out) + "\n"


def update_readme(readme: Path, results_md: str, rel_dir: str = "results") -> None:
    """Replace the marked section of the README with the latest results (image paths made relative)."""
    body = results_md.replace("# Blendserve benchmark results", "### Latest results", 1)
    body = re.sub(r"^## ", "#### ", body, flags=re.M).replace("### Paired", "##### Paired").replace("### Goals", "##### Goals")
    body = re.sub(r"\]\((\w+\.png)\)", rf"]({rel_dir}/\1)", body)
    text = readme.read_text(encoding="utf-8") if readme.exists() else ""
    section = f"{README_START}\n{body}{README_END}"
    if README_START in text and README_END in text:
        head, rest = text.split(README_START, 1)
        text = head + section + rest.split(README_END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    readme.write_text(text, encoding="utf-8")
