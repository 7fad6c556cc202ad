"""Benchmark entry point: quality (HotpotQA, MuSiQue), TTFT per mode and tier, service throughput, llama.cpp peer.

    python -m benchmarks.run --quick      # the short run behind `make bench` (under 10 min on 2 cores)
    python -m benchmarks.run --full       # the documented full run
    python -m benchmarks.run --quick --n-musique 5 --skip throughput,peer --out-dir /tmp/bench

Writes results.json, results.md and PNG plots under --out-dir (default benchmarks/results/) and, for
the default out dir, refreshes the results section of benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common.data import build_context, load_examples
from benchmarks.common.plots import plot_f1_vs_ratio, plot_ttft_vs_context
from benchmarks.common.report import render, update_readme
from benchmarks.load.throughput import run_throughput
from benchmarks.peers import peer as peer_mod
from benchmarks.quality.quality import records_as_dicts, run_quality, summarize
from benchmarks.ttft.perf import run_perf
from blend_engine.model.runner import ModelRunner

logger = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"
PARTS = ("quality", "perf", "throughput", "peer")


@dataclass
class BenchConfig:
    n_musique: int = 12
    n_hotpotqa: int = 12
    max_paragraphs: int | None = 4  # supporting paragraphs + first distractors; None = all
    group_words: int | None = None  # merge paragraphs into ~N-word passages
    max_tokens: int = 24
    perf_tokens: tuple[int, ...] = (1000, 2000)
    perf_trials: int = 1
    tiers: tuple[str, ...] = ("ram", "disk")
    clients: int = 3
    throughput_requests: int = 6
    throughput_paragraphs: int | None = 8
    throughput_max_tokens: int = 4
    data_dir: Path | None = None
    skip: tuple[str, ...] = ()
    threads: int = 2
    command: str = ""
    notes: list[str] = field(default_factory=list)


QUICK = BenchConfig()
FULL = BenchConfig(n_musique=100, n_hotpotqa=100, max_paragraphs=None, max_tokens=32, perf_tokens=(1000, 2000, 4000, 6000),
                   perf_trials=3, clients=8, throughput_requests=32, throughput_paragraphs=None)


def _passage_layout(cfg: BenchConfig) -> str:
    base = ("all paragraphs" if cfg.max_paragraphs is None
            else f"supporting paragraphs + distractors, at most {cfg.max_paragraphs}")
    return base + (f", grouped to ~{cfg.group_words} words" if cfg.group_words else ", one paragraph per passage")


def run_benchmark(cfg: BenchConfig, out_dir: Path, runner: ModelRunner | None = None, readme: Path | None = None) -> dict:
    """Run the selected parts, write results.json / results.md / plots into out_dir; returns the results."""
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    runner = runner or ModelRunner.load()
    musique = load_examples("musique", max(cfg.n_musique, cfg.throughput_requests), cfg.data_dir)
    hotpot = load_examples("hotpotqa", cfg.n_hotpotqa, cfg.data_dir)
    results: dict = {"config": _jsonable(dataclasses.asdict(cfg))}
    if "quality" not in cfg.skip:
        records = run_quality(musique[:cfg.n_musique] + hotpot, runner, max_tokens=cfg.max_tokens,
                              max_paragraphs=cfg.max_paragraphs, group_words=cfg.group_words)
        results["records"] = records_as_dicts(records)
        results["quality"] = summarize(records)
        plot_f1_vs_ratio(results["quality"], out_dir / "f1_vs_ratio.png")
    if "perf" not in cfg.skip:
        rows = run_perf(musique, runner, cfg.perf_tokens, cfg.tiers, cfg.perf_trials)
        results["perf"] = [dataclasses.asdict(r) for r in rows]
    if "peer" not in cfg.skip:
        _run_peer(cfg, runner, musique, results)
    if results.get("perf"):
        plot_ttft_vs_context(results["perf"], out_dir / "ttft_vs_context.png", results.get("peer"))
    if "throughput" not in cfg.skip:
        _run_throughput(cfg, musique, results, out_dir)
    results["meta"] = _meta(cfg, runner, musique, hotpot, time.perf_counter() - t0)
    (out_dir / "results.json").write_text(json.dumps(_jsonable(results), indent=1), encoding="utf-8")
    md = render(results)
    (out_dir / "results.md").write_text(md, encoding="utf-8")
    if readme is not None:
        update_readme(readme, md, os.path.relpath(out_dir, readme.parent))
    return results


def _run_throughput(cfg: BenchConfig, musique, results: dict, out_dir: Path) -> None:
    try:
        rows = run_throughput(musique[:cfg.throughput_requests], cfg.clients, cfg.throughput_paragraphs,
                              cfg.throughput_max_tokens, keep_log=out_dir / "server.log")
    except (RuntimeError, TimeoutError, OSError) as exc:  # keep the other parts' results
        logger.error("throughput run failed: %s", exc)
        cfg.notes.append(f"throughput run failed: {exc}")
        return
    results["throughput"] = [dataclasses.asdict(r) for r in rows]


def _run_peer(cfg: BenchConfig, runner: ModelRunner, musique, results: dict) -> None:
    ok, why = peer_mod.available()
    if not ok:
        logger.warning(why)
        results["peer_note"] = why
        return
    count = lambda text: len(runner.encode(text))  # noqa: E731
    contexts = [(t, build_context(musique, t, count, start=i)) for i, t in enumerate(cfg.perf_tokens)]
    results["peer"] = [dataclasses.asdict(r) for r in peer_mod.run_peer(contexts, runner, cfg.threads)]


def _meta(cfg: BenchConfig, runner: ModelRunner, musique, hotpot, elapsed: float) -> dict:
    n_q = 0 if "quality" in cfg.skip else cfg.n_musique + len(hotpot)
    return {
        "command": cfg.command or "python -m benchmarks.run",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "elapsed_s": elapsed,
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared with other jobs: timings are noisy), "
                   f"torch threads {cfg.threads}",
        "model": getattr(runner, "name", "?"),
        "examples": f"{min(cfg.n_musique, len(musique))} MuSiQue + {len(hotpot)} HotpotQA dev" if n_q else "quality skipped",
        "passage_layout": _passage_layout(cfg),
        "notes": cfg.notes,
    }


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, Path, bool]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the short run (default)")
    size.add_argument("--full", action="store_true", help="all paragraphs, 100+100 examples, 1K-6K contexts")
    p.add_argument("--data-dir", type=Path, default=None, help="folder with hotpotqa_dev500.jsonl and musique_dev.jsonl")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--n-musique", type=int)
    p.add_argument("--n-hotpotqa", type=int)
    p.add_argument("--max-paragraphs", type=int, help="0 = all paragraphs")
    p.add_argument("--group-words", type=int, help="group paragraphs into passages of ~N words (e.g. 350)")
    p.add_argument("--perf-tokens", type=str, help="comma-separated context sizes, e.g. 1000,2000,4000,6000")
    p.add_argument("--max-tokens", type=int, help="generated tokens per answer (greedy, stops at a newline)")
    p.add_argument("--clients", type=int)
    p.add_argument("--throughput-requests", type=int)
    p.add_argument("--skip", type=str, default="", help=f"comma-separated parts to skip: {','.join(PARTS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-readme", action="store_true", help="do not refresh benchmarks/README.md")
    a = p.parse_args(argv)
    cfg = dataclasses.replace(FULL if a.full else QUICK, data_dir=a.data_dir, threads=a.threads,
                              command="python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]))
    overrides = {"max_tokens": a.max_tokens, "n_musique": a.n_musique, "n_hotpotqa": a.n_hotpotqa, "group_words": a.group_words,
                 "clients": a.clients, "throughput_requests": a.throughput_requests}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if a.max_paragraphs is not None:
        cfg.max_paragraphs = a.max_paragraphs or None
    if a.perf_tokens:
        cfg.perf_tokens = tuple(int(x) for x in a.perf_tokens.split(","))
    cfg.skip = tuple(s for s in a.skip.split(",") if s)
    unknown = set(cfg.skip) - set(PARTS)
    if unknown:
        p.error(f"unknown parts to skip: {sorted(unknown)}")
    return cfg, a.out_dir, not a.no_readme and a.out_dir.resolve() == DEFAULT_OUT


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg, out_dir, readme = parse_args(argv)
    results = run_benchmark(cfg, out_dir, readme=HERE / "README.md" if readme else None)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
