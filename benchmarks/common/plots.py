"""PNG plots: F1 vs recompute ratio (with full prefill / full reuse references) and TTFT vs context length."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_f1_vs_ratio(summary: dict, path: Path) -> Path:
    """One panel per dataset (and pooled): blend F1 at each ratio with 95% CIs, reference lines."""
    table = summary["table"]
    names = list(table)
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    for ax, ds in zip(axes[0], names):
        modes = table[ds]
        blend = sorted((m["mean_ratio"], m["f1"]) for name, m in modes.items() if name.startswith("blend@0"))
        if blend:
            xs = [x for x, _ in blend]
            ys = [f["mean"] for _, f in blend]
            err = [[f["mean"] - f["low"] for _, f in blend], [f["high"] - f["mean"] for _, f in blend]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label="blend (fixed ratio)")
        if "blend@auto" in modes:
            a = modes["blend@auto"]
            ax.plot([a["mean_ratio"]], [a["f1"]["mean"]], "s", color="tab:purple", label="blend (bandwidth ratio)")
        for name, color in (("full_prefill", "tab:green"), ("full_reuse", "tab:red")):
            if name in modes:
                m = modes[name]["f1"]
                ax.axhline(m["mean"], color=color, linestyle="--", label=name)
                ax.axhspan(m["low"], m["high"], color=color, alpha=0.08)
        ax.set_title(f"{ds} (n={next(iter(modes.values()))['n']})")
        ax.set_xlabel("recompute ratio")
        ax.set_ylabel("token F1")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_vs_context(perf_rows: list[dict], path: Path, peer_rows: list[dict] | None = None) -> Path:
    """TTFT per mode against context tokens; solid RAM, dashed disk, dotted llama.cpp."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in perf_rows:
        series.setdefault((r["mode"], r["tier"]), []).append((r["context_tokens"], r["ttft_ms"]))
    for (mode, tier), pts in sorted(series.items()):
        pts.sort()
        style = {"ram": "-", "disk": "--"}.get(tier, "-")
        label = mode if tier == "-" else f"{mode} ({tier})"
        ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], style, marker="o", label=label)
    for case in sorted({r["case"] for r in peer_rows or []}):
        pts = sorted((r["context_tokens"], r["ttft_ms"]) for r in peer_rows if r["case"] == case)
        ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], ":", marker="x", label=f"llama.cpp {case}")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("time to first token (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
