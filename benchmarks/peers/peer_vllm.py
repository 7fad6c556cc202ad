"""Side by side with vLLM (issues #37, #55): the same model, prompts, greedy settings and cores,
through each system's HTTP API, one system after the other: vLLM alone, Blendserve alone, and
Blendserve + vLLM (Blendserve blends, a vLLM server with `blendserve_vllm.connector` decodes;
`make run-vllm`'s pair).

1. RAG first tokens: MuSiQue and HotpotQA questions with their passages (then other questions'
   passages) up to ~2K/~4K/~8K-token prompts. Per question: cold, the same order again, the
   passages in another order. vLLM (automatic prefix caching) gets the passages in the prompt;
   Blendserve gets them as the request's `documents`, served from its KV store: cold by full
   prefill, then a cold blend request whose missed passages are stored (the ingestion cost,
   `kv_store_ms`), then blend hits; optionally its prefix_cache mode too.
2. Under load: 1/8/16 concurrent clients, 3 passages each, natural answer lengths (up to
   --max-tokens): output tokens/s and TTFT p50/p95. `new_combination`: every prompt's passages were
   seen once before in another order (a warm pass), as retrieval returns known passages in new
   combinations; then `repeated`: the same prompts again.
3. Fidelity: the first token's top-20 logprobs; KL of Blendserve's full prefill against vLLM, of
   its blend against vLLM, and of its blend against its own full prefill.

    make bench-peer-vllm-install                    # once: .venv-vllm and the model folder
    make bench-peer-vllm ARGS=--quick               # python -m benchmarks.peers.peer_vllm --quick

Results: benchmarks/results/peer_vllm/peer_vllm{,_quick}.{json,md,png}, written whole at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.vllm_launcher import beside_vllm, cpu_list
from benchmarks.common.client_gc import no_gc_pauses
from benchmarks.common.data import Example, load_examples, passages_of, select_paragraphs, shuffled
from benchmarks.common.service import free_port
from benchmarks.common.vllm_model import ensure_model_folder
from benchmarks.peers.peer_vllm_client import Reply, blend_body, blend_call, prompt_ids, token_text_of, vllm_body, vllm_call
from benchmarks.peers.peer_vllm_report import (
    BLEND,
    NEW_COMBINATION,
    PAIR,
    REPEATED,
    SYSTEMS,
    VLLM,
    FidelityRow,
    LoadRow,
    RagSample,
    Report,
    kl_top,
    markdown,
    percentile,
    top1,
    write_results,
)
from benchmarks.peers.peer_vllm_servers import (
    REPO,
    RUN_TARGET,
    SERVED_NAME,
    VLLM_VENV,
    PeerSetupError,
    VllmSettings,
    blendserve_server,
    pair_vllm_server,
    vllm_python,
    vllm_server,
)
from retrieval.text import format_passage

logger = logging.getLogger(__name__)
OUT = REPO / "benchmarks" / "results" / "peer_vllm"
GROUP_WORDS = 300  # paragraphs merged into passages of ~300 words (~400 tokens): an 8K prompt stays under 32 documents
LOAD_PASSAGES = 3
WARM_QUESTION = "What is this passage about?"
WARM_PASSAGE = "A short warm-up passage that no question of the benchmark uses."


@dataclass(frozen=True)
class RagPrompt:
    dataset: str
    size: int
    question: str
    passages: tuple[str, ...]
    reordered: tuple[str, ...]
    ids: tuple[int, ...]
    reordered_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadPrompt:
    question: str
    passages: tuple[str, ...]
    ids: tuple[int, ...]
    warm_passages: tuple[str, ...]  # the same passages in reverse order, sent once before the level
    warm_ids: tuple[int, ...]


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.peer_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="one question per size (the datasets in turn), 1 round per load level, no prefix_cache cases")
    p.add_argument("--sizes", default="2000,4000,7600", help="prompt token targets (comma-separated; <= 8000)")
    p.add_argument("--questions", type=int, default=3, help="questions per dataset and size (--quick: 1)")
    p.add_argument("--datasets", default="musique,hotpotqa")
    p.add_argument("--clients", default="1,8,16")
    p.add_argument("--rounds", type=int, default=2, help="requests per client at each load level (--quick: 1)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length cap under load (natural lengths)")
    p.add_argument("--skip", default="", help="phases to leave out: rag, load, prefix_cache")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"which to run, of {', '.join(SYSTEMS)}")
    p.add_argument("--cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--pair-cores", default="", metavar="BLENDSERVE:VLLM",
                   help="Blendserve + vLLM on cores of their own, e.g. 0:1 (Blendserve under taskset with that "
                        "many OpenMP threads, vLLM bound to the rest); default: both on --cores")
    p.add_argument("--kv-space-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds each server may take to come up")
    p.add_argument("--out-dir", type=Path, default=OUT)
    args = p.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        p.error("--sizes and --clients take comma-separated integers")
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    _check_args(p, args)
    if args.quick:
        args.questions, args.rounds = 1, 1
        args.skip.add("prefix_cache")
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.sizes or any(not 256 <= s <= 8000 for s in args.sizes):
        p.error("--sizes: each between 256 and 8000 tokens (the model's context is 8192)")
    if not args.clients or any(c < 1 for c in args.clients):
        p.error("--clients: positive integers")
    if unknown := set(args.datasets) - {"musique", "hotpotqa"}:
        p.error(f"--datasets: unknown {sorted(unknown)}; musique and/or hotpotqa")
    if unknown := args.skip - {"rag", "load", "prefix_cache"}:
        p.error(f"--skip: unknown {sorted(unknown)}; rag, load, prefix_cache")
    if not args.systems or (unknown := set(args.systems) - set(SYSTEMS)):
        p.error(f"--systems: one or more of {', '.join(SYSTEMS)}")
    if args.questions < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--questions, --rounds and --max-tokens must be at least 1")


# ----------------------------------------------------------------------------- workloads


class ExamplePool:
    """Examples handed out once each, so that no two prompts share a passage."""

    def __init__(self, datasets: Sequence[str]) -> None:
        self._examples = {d: load_examples(d, 10_000) for d in datasets}
        self._next = dict.fromkeys(datasets, 0)

    def take(self, dataset: str) -> Example:
        i = self._next[dataset]
        if i >= len(self._examples[dataset]):
            raise ValueError(f"{dataset}: all {i} examples used; ask for fewer questions or smaller prompts")
        self._next[dataset] = i + 1
        return self._examples[dataset][i]


def rag_prompt(pool: ExamplePool, dataset: str, size: int, tokenizer: Any) -> RagPrompt:
    """The next unused question with its passages, then further questions' passages, up to `size` tokens."""
    first = pool.take(dataset)
    passages: list[str] = []
    ex = first
    while True:
        for p in passages_of(ex, group_words=GROUP_WORDS):
            if len(prompt_ids(tokenizer, (*passages, p), first.question)) > size:
                return _rag(dataset, size, first.question, tuple(passages), tokenizer)
            passages.append(p)
        ex = pool.take(dataset)


def _rag(dataset: str, size: int, question: str, passages: tuple[str, ...], tokenizer: Any) -> RagPrompt:
    if len(passages) < 2:
        raise ValueError(f"a {size}-token prompt holds fewer than 2 passages; use a larger size")
    reordered = shuffled(passages, f"peer-vllm-{size}")
    return RagPrompt(dataset, size, question, passages, reordered, tuple(prompt_ids(tokenizer, passages, question)),
                     tuple(prompt_ids(tokenizer, reordered, question)))


def load_prompt(ex: Example, tokenizer: Any) -> LoadPrompt:
    passages = tuple(format_passage(p.text, p.title) for p in select_paragraphs(ex, LOAD_PASSAGES)[:LOAD_PASSAGES])
    warm = tuple(reversed(passages))
    return LoadPrompt(ex.question, passages, tuple(prompt_ids(tokenizer, passages, ex.question)), warm,
                      tuple(prompt_ids(tokenizer, warm, ex.question)))


def rag_plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(dataset, size) per RAG prompt: every dataset at every size, or with --quick one per size, in turn."""
    if args.quick:
        return [(args.datasets[j % len(args.datasets)], size) for j, size in enumerate(args.sizes)]
    return [(d, size) for size in args.sizes for d in args.datasets for _ in range(args.questions)]


def build_workloads(args: argparse.Namespace, tokenizer: Any) -> tuple[list[RagPrompt], dict[int, list[LoadPrompt]]]:
    pool = ExamplePool(args.datasets)
    rag = [] if "rag" in args.skip else [rag_prompt(pool, d, size, tokenizer) for d, size in rag_plan(args)]
    load: dict[int, list[LoadPrompt]] = {}
    if "load" not in args.skip:
        for clients in args.clients:
            n = max(clients * args.rounds, 4)
            load[clients] = [load_prompt(pool.take(args.datasets[i % len(args.datasets)]), tokenizer) for i in range(n)]
    return rag, load


# ----------------------------------------------------------------------------- one system's run


Call = Callable[[httpx.AsyncClient, dict[str, Any]], Awaitable[Reply]]


@dataclass
class SystemRun:
    """One system's replies: RAG per (prompt index, case) and its load rows."""

    rag: dict[tuple[int, str], Reply]
    load: list[LoadRow]
    load_avg: dict[tuple[int, str], float] = field(default_factory=dict)  # 1-minute load average per RAG reply


async def _sequential(http: httpx.AsyncClient, call: Call, bodies: Sequence[dict[str, Any]]) -> list[Reply]:
    return [await call(http, b) for b in bodies]


async def load_level(http: httpx.AsyncClient, call: Call, system: str, bodies: list[dict[str, Any]],
                     clients: int, label: str = "load", kind: str = NEW_COMBINATION) -> LoadRow:
    """`clients` concurrent clients draining `bodies`; failures are counted, not raised."""
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    replies: list[Reply] = []
    errors: list[str] = []

    async def client() -> None:
        while not queue.empty():
            body = queue.get_nowait()
            try:
                replies.append(await call(http, body))
            except Exception as exc:  # noqa: BLE001 - counted in the row, the level goes on
                errors.append(repr(exc))

    with no_gc_pauses():
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - t0
    for e in errors[:3]:
        logger.warning("%s, %d clients: %s", system, clients, e)
    tokens = sum(r.output_tokens for r in replies)
    ttft = [r.ttft_ms for r in replies]
    row = LoadRow(system, clients, len(bodies), len(replies), len(errors), seconds, tokens, tokens / seconds,
                  percentile(ttft, 50), percentile(ttft, 95), os.getloadavg()[0], server_p50(replies), kind,
                  prefix_hit_share(replies), longest(replies))
    share = "" if row.prefix_hit_share is None else f", prefix hits {row.prefix_hit_share:.1%} of prompt tokens"
    logger.info("%s %s %2d clients: %.1f tok/s, TTFT p50 %.0f ms, %d errors%s", system, label, clients,
                row.tokens_per_s, row.ttft_p50_ms, row.errors, share)
    return row


def longest(replies: Sequence[Reply]) -> tuple[int, float, float] | None:
    """The longest answer of a level (output tokens, client ms to its first and to its last token): a
    level ends no sooner than that answer's decode, whoever prefilled it."""
    r = max(replies, key=lambda r: r.output_tokens, default=None)
    return None if r is None or r.total_ms is None else (r.output_tokens, r.ttft_ms, r.total_ms)


def prefix_hit_share(replies: Sequence[Reply]) -> float | None:
    """Blendserve's replies: the share of their prompt tokens taken as a cached prefix (the KV pool's,
    `stats.prefix_tokens_reused`; with vLLM decoding, the tokens vLLM did not compute,
    `stats.decoder_cached_tokens`); None for vLLM alone (its stream reports none)."""
    stats = [r.body["stats"] for r in replies if r.body.get("stats")]
    total = sum(s["context_tokens"] for s in stats)
    if not total:
        return None
    hit = sum((s.get("decoder_cached_tokens") if s.get("decoder") == "vllm" else s.get("prefix_tokens_reused")) or 0
              for s in stats)
    return hit / total


def server_p50(replies: Sequence[Reply]) -> dict[str, float] | None:
    """Blendserve's own `timings`, each field's median over the replies; None for vLLM (it reports none)."""
    timings = [r.body["timings"] for r in replies if r.body.get("timings")]
    keys = [k for k in (timings[0] if timings else ()) if any(t.get(k) is not None for t in timings)]
    return {k: percentile([t[k] for t in timings if t.get(k) is not None], 50) for k in keys} if keys else None


async def run_load(http: httpx.AsyncClient, call: Call, system: str, levels: dict[int, list[LoadPrompt]],
                   body: Callable[[LoadPrompt, bool, int], dict[str, Any]], settle: Settle) -> list[LoadRow]:
    rows = []
    for clients, prompts in levels.items():
        warm = [body(p, True, 1) for p in prompts]
        await load_level(http, call, system, warm, min(4, clients), "warm pass")  # passages seen in another order
        await settle(http)  # Blendserve stores the warm pass's passages after answering: wait for it
        level = [body(p, False, 0) for p in prompts]
        rows.append(await load_level(http, call, system, level, clients, NEW_COMBINATION))
        rows.append(await load_level(http, call, system, level, clients, REPEATED, REPEATED))  # each again
    return rows


def vllm_cases(p: RagPrompt) -> list[tuple[str, dict[str, Any]]]:
    a, b = list(p.ids), list(p.reordered_ids)
    return [("cold", vllm_body(a, 1, True)), ("same_order", vllm_body(a, 1, True)),
            ("reordered", vllm_body(b, 1, True))]


def blend_cases(p: RagPrompt, prefix_cache: bool) -> list[tuple[str, dict[str, Any]]]:
    def q(passages: tuple[str, ...], mode: str) -> dict[str, Any]:
        return blend_body(passages, p.question, 1, mode, True)

    # the cold blend first: the engine's prefix cache serves any mode from exact (full-prefill) KV, so
    # after the full prefill the same prompt in blend would be a prefix hit, not an ingestion
    cases = [("cold_blend_ingest", q(p.passages, "blend")), ("cold_full_prefill", q(p.passages, "full_prefill")),
             ("same_order_blend", q(p.passages, "blend")), ("reordered_blend", q(p.reordered, "blend"))]
    if prefix_cache:
        cases += [("cold_prefix_cache", q(p.passages, "prefix_cache")),
                  ("same_order_prefix_cache", q(p.passages, "prefix_cache"))]
    return cases


Settle = Callable[[httpx.AsyncClient], Awaitable[None]]


async def settled(http: httpx.AsyncClient) -> None:
    """vLLM: nothing runs after its answers."""


def store_settled(url: str, timeout_s: float = 900.0) -> Settle:
    """Blendserve: wait until the passages its answers queued for storing are stored (its /metrics
    `blendserve_kv_store_queued` is 0), so that each case starts on an idle engine."""
    async def wait(http: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = (await http.get(f"{url}/metrics")).text
            queued = [ln for ln in text.splitlines() if ln.startswith("blendserve_kv_store_queued ")]
            if not queued or float(queued[0].rpartition(" ")[2]) == 0:
                return
            await asyncio.sleep(0.2)
        raise PeerSetupError(f"Blendserve's store queue did not drain within {timeout_s:.0f} s")
    return wait


async def run_system(url: str, call: Call, system: str, rag: list[RagPrompt],
                     cases: Callable[[RagPrompt], list[tuple[str, dict[str, Any]]]], warm: dict[str, Any],
                     levels: dict[int, list[LoadPrompt]],
                     load_body: Callable[[LoadPrompt, bool, int], dict[str, Any]], settle: Settle = settled) -> SystemRun:
    async with httpx.AsyncClient(timeout=3600) as http:
        await _sequential(http, call, [warm, warm])
        replies: dict[tuple[int, str], Reply] = {}
        load_avg: dict[tuple[int, str], float] = {}
        for i, prompt in enumerate(rag):
            for case, body in cases(prompt):
                with no_gc_pauses():  # the client's collector must not land in the TTFT it times
                    replies[i, case] = await call(http, body)
                load_avg[i, case] = os.getloadavg()[0]
                await settle(http)
                logger.info("%s %s ~%d (%s): TTFT %.0f ms (load %.1f)", system, case, prompt.size, prompt.dataset,
                            replies[i, case].ttft_ms, load_avg[i, case])
        return SystemRun(replies, await run_load(http, call, system, levels, load_body, settle), load_avg)


# ----------------------------------------------------------------------------- the two systems


def run_vllm(args: argparse.Namespace, model_dir: Path, rag: list[RagPrompt], levels: dict[int, list[LoadPrompt]],
             tokenizer: Any, log_dir: Path) -> SystemRun:
    settings = VllmSettings(cores=args.cores, kv_space_gb=args.kv_space_gb)
    token_text = token_text_of(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    async def call(http: httpx.AsyncClient, body: dict[str, Any]) -> Reply:
        return await vllm_call(http, url, body, token_text)

    def load_body(p: LoadPrompt, warm: bool, max_tokens: int) -> dict[str, Any]:
        return vllm_body(list(p.warm_ids if warm else p.ids), max_tokens or args.max_tokens, False)

    warm = vllm_body(prompt_ids(tokenizer, (WARM_PASSAGE,), WARM_QUESTION), 4, True)
    with vllm_server(model_dir, settings, log_dir / "vllm.log", free_port(), args.start_timeout) as url:
        return asyncio.run(run_system(url, call, VLLM, rag, vllm_cases, warm, levels, load_body))


def run_blendserve(args: argparse.Namespace, rag: list[RagPrompt], levels: dict[int, list[LoadPrompt]],
                   log_dir: Path, system: str = BLEND, decoder_env: dict[str, str] | None = None,
                   wrapper: list[str] | None = None) -> SystemRun:
    async def call(http: httpx.AsyncClient, body: dict[str, Any]) -> Reply:
        return await blend_call(http, url, body)

    def load_body(p: LoadPrompt, warm: bool, max_tokens: int) -> dict[str, Any]:
        return blend_body(p.warm_passages if warm else p.passages, p.question, max_tokens or args.max_tokens,
                          "blend", False)

    warm = blend_body((WARM_PASSAGE,), WARM_QUESTION, 4, "blend", True)
    prefix_cache = "prefix_cache" not in args.skip and system == BLEND
    log = log_dir / ("blendserve.log" if system == BLEND else "blendserve-pair.log")
    with tempfile.TemporaryDirectory(prefix="blendserve-peer-vllm-") as data_dir:
        with blendserve_server(Path(data_dir), log, free_port(), args.start_timeout, decoder_env, wrapper) as url:
            return asyncio.run(run_system(url, call, system, rag, lambda p: blend_cases(p, prefix_cache), warm,
                                          levels, load_body, store_settled(url)))


def run_pair(args: argparse.Namespace, model_dir: Path, rag: list[RagPrompt], levels: dict[int, list[LoadPrompt]],
             log_dir: Path) -> SystemRun:
    """Blendserve with BLENDSERVE_DECODER_KIND=vllm in front of a vLLM server that loads its KV through
    `blendserve_vllm.connector` (what `make run-vllm` starts), both on the same cores."""
    ours, theirs = args.pair_cores.split(":") if args.pair_cores else ("", args.cores)
    settings = VllmSettings(cores=theirs, kv_space_gb=args.kv_space_gb)
    with tempfile.TemporaryDirectory(prefix="blendserve-segments-", dir="/dev/shm") as segments:
        with pair_vllm_server(model_dir, settings, Path(segments), log_dir / "vllm-pair.log", free_port(),
                              args.start_timeout) as url:
            env = {"BLENDSERVE_DECODER_KIND": "vllm", "BLENDSERVE_DECODER_VLLM_URL": url,
                   "BLENDSERVE_DECODER_SEGMENT_DIR": segments, "BLENDSERVE_DECODER_VLLM_MODEL": SERVED_NAME}
            if ours:
                env["OMP_NUM_THREADS"] = str(len(cpu_list(ours)))
            else:  # the same cores: as `make run-vllm` starts it
                env |= beside_vllm(dict(os.environ))
            return run_blendserve(args, rag, levels, log_dir, PAIR, env, ["taskset", "-c", ours] if ours else [])


# ----------------------------------------------------------------------------- the report


def rag_samples(rag: list[RagPrompt], runs: dict[str, SystemRun]) -> list[RagSample]:
    out = []
    for system, run in runs.items():
        for (i, case), r in run.rag.items():
            p = rag[i]
            tokens = len(p.reordered_ids if case.startswith("reordered") else p.ids)
            timings, stats = r.body.get("timings") or {}, r.body.get("stats") or {}
            out.append(RagSample(system, case, p.dataset, p.size, tokens, r.ttft_ms, timings.get("ttft_ms"),
                                 timings.get("kv_store_ms"), stats.get("cache_hits"), stats.get("cache_misses"),
                                 r.body.get("mode"), run.load_avg.get((i, case)), timings or None))
    return out


def fidelity_rows(rag: list[RagPrompt], vllm: SystemRun, blend: SystemRun) -> list[FidelityRow]:
    rows = []
    for i, p in enumerate(rag):
        ref, full, mixed = vllm.rag[i, "cold"].top, blend.rag[i, "cold_full_prefill"].top, blend.rag[i, "same_order_blend"].top
        ref_b, mixed_b = vllm.rag[i, "reordered"].top, blend.rag[i, "reordered_blend"].top
        if not (ref and full and mixed and ref_b and mixed_b):
            logger.warning("prompt %d: a reply without logprobs; no fidelity row", i)
            continue
        rows.append(FidelityRow(p.dataset, p.size, kl_top(ref, full), kl_top(ref, mixed), kl_top(full, mixed),
                                kl_top(ref_b, mixed_b), top1(full) == top1(ref), top1(mixed) == top1(ref)))
    return rows


def _vllm_versions() -> dict[str, str]:
    code = ("import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'), "
            "m.version('transformers'))")
    out = subprocess.run([str(vllm_python()), "-c", code], capture_output=True, text=True, timeout=120, check=True)
    vllm, torch, transformers = out.stdout.split()
    return {"vllm-cpu": vllm, "torch (vLLM venv)": torch, "transformers (vLLM venv)": transformers}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def settings_of(args: argparse.Namespace, model_dir: Path, argv: Sequence[str]) -> dict[str, Any]:
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    return {"command": "python -m benchmarks.peers.peer_vllm " + " ".join(argv), "quick": args.quick,
            "blendserve_commit": commit.strip(), "torch (Blendserve)": torch.__version__,
            "transformers (Blendserve)": transformers.__version__, **_vllm_versions(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "load_average_at_start": os.getloadavg(), "model_folder": str(model_dir), "dtype": "float32",
            "vllm": {**VllmSettings(cores=args.cores, kv_space_gb=args.kv_space_gb).as_dict(),
                     "server": "python -m vllm.entrypoints.openai.api_server"},
            "blendserve": "python -m app, defaults, scratch BLENDSERVE_DATA_DIR, no sample corpus, DTYPE=float32",
            "blendserve+vllm": "the same Blendserve with BLENDSERVE_DECODER_KIND=vllm, and vLLM as above with "
                               "--kv-transfer-config blendserve_vllm.connector (app.vllm_launcher.vllm_command)",
            "systems": args.systems, "pair_cores": args.pair_cores or f"shared {args.cores}",
            "sizes": args.sizes, "datasets": args.datasets, "questions_per_dataset_and_size": args.questions,
            "clients": args.clients, "load_rounds": args.rounds, "load_max_tokens": args.max_tokens,
            "group_words": GROUP_WORDS, "greedy": "temperature 0", "skip": sorted(args.skip)}


def build_report(settings: dict[str, Any], rag: list[RagPrompt], runs: dict[str, SystemRun]) -> Report:
    report = Report(settings, rag_samples(rag, runs), [row for run in runs.values() for row in run.load])
    if rag and VLLM in runs and BLEND in runs:  # the pair decodes on vLLM: its logprobs are vLLM's
        report.fidelity = fidelity_rows(rag, runs[VLLM], runs[BLEND])
    fallbacks = [s for s in report.rag if s.system != VLLM and "blend" in s.case and s.mode not in (None, "blend")]
    if fallbacks:
        report.notes.append(f"{len(fallbacks)} Blendserve blend request(s) were served as {fallbacks[0].mode} "
                            "(the bandwidth controller or the fidelity gate)")
    return report


# ----------------------------------------------------------------------------- main


def run(argv: Sequence[str]) -> list[Path]:
    args = parse_args(argv)
    vllm_python()  # a missing install fails before anything else runs
    from transformers import AutoTokenizer

    model_dir = ensure_model_folder()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rag, levels = build_workloads(args, tokenizer)
    logger.info("%d RAG prompts, load levels %s", len(rag), {c: len(p) for c, p in levels.items()})
    settings = settings_of(args, model_dir, argv)
    log_dir = args.out_dir / "logs"
    runners = {VLLM: lambda: run_vllm(args, model_dir, rag, levels, tokenizer, log_dir),
               BLEND: lambda: run_blendserve(args, rag, levels, log_dir),
               PAIR: lambda: run_pair(args, model_dir, rag, levels, log_dir)}
    runs = {system: runners[system]() for system in args.systems}
    report = build_report(settings, rag, runs)
    files = write_results(report, args.out_dir, "peer_vllm_quick" if args.quick else "peer_vllm")
    print(markdown(report))
    return files


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request and per readiness poll
    try:
        files = run(argv)
    except (PeerSetupError, ValueError, FileNotFoundError) as exc:  # setup, workload or data: no results written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logger.info("results: %s (target: %s, vLLM venv: %s)", ", ".join(map(str, files)), RUN_TARGET, VLLM_VENV)
    return 0


if __name__ == "__main__":
    sys.exit(main())
