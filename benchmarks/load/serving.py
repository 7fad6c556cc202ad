"""Serving under concurrency: 1, 2, 4, 8 and 16 clients streaming /v1/query on retrieved
sample-corpus questions (top_k 5), at max_tokens 32 and 128, against `python -m app` with its
default settings (continuous batching: BLENDSERVE_ENGINE_MAX_BATCH, BLENDSERVE_ENGINE_BATCH_KV_MB).

Per level: answers/s, output tokens/s, p50/p95/p99 time to first token, p50/p99 inter-token latency
(gaps between streamed deltas), and 503s; from the service's /metrics, the engine's share of the
level spent in steps, its mean batch, its decode-only and prefill-carrying steps; and the tokens/s
while every client had a request (until a client first found none left: the level's drain after it
runs without new prefills). Answers decode to max_tokens (`ignore_eos`, as vLLM's benchmarks do),
so the token counts are the ones asked for, unless `--natural` (they end at EOS).

    python -m benchmarks.load.serving [--clients 1,2,4,8,16] [--max-tokens 32,128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common.data import load_examples
from benchmarks.common.service import REPO, app_process, free_port

logger = logging.getLogger(__name__)
OUT = REPO / "benchmarks" / "results" / "serving"
MIN_REQUESTS = 8  # the fewest requests a level makes (its medians need a few)
MAX_RETRIES = 30  # 503s one query takes before the client gives it up
WARMUP = 4  # questions of the warm-up's own (its level makes MIN_REQUESTS requests over them)
PREFIX_CACHING = "BLENDSERVE_ENGINE_PREFIX_CACHING"


@dataclass(frozen=True)
class ServingRow:
    max_tokens: int
    clients: int
    requests: int
    answered: int
    rejected_503: int  # 503s answered (a refused query is asked again after its Retry-After)
    errors: int
    seconds: float
    answers_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    peak_running: int = 0  # most requests in the engine's batch at once (sampled from /metrics)
    peak_pool_blocks: int = 0  # most KV pool blocks in use at once (sampled)
    pool_blocks: int = 0
    preemptions: int = 0  # during this level
    prefix_hit_tokens: int = 0  # prompt tokens taken from the pool's prefix cache during this level
    decode_step_ms: float = float("nan")  # mean engine step with decode rows only, during this level
    prefill_step_ms: float = float("nan")  # mean engine step carrying prefill rows
    step_cores: float = float("nan")  # the service's CPU time over its engine steps' wall time
    engine_busy: float = float("nan")  # the engine's step time over the level's wall time
    mean_running: float = float("nan")  # requests in the engine's batch, mean of the /metrics samples
    full_s: float = float("nan")  # seconds until a client first found no request left (the drain starts)
    full_tokens_per_s: float = float("nan")  # output tokens/s streamed while every client had a request
    ttft_p95_ms: float = float("nan")
    decode_steps: int = 0  # engine steps with decode rows only, during this level
    prefill_steps: int = 0  # engine steps carrying prefill rows
    prompt_tokens: float = float("nan")  # mean prompt of the level's answers (levels ask different questions)
    answer_tokens: float = float("nan")  # mean answer
    # prefill steps' seconds per prefill token-layer (`blendserve_engine_prefill_token_layers`; decode rows riding
    # those steps included): the rate of prefill work, alone (one client) and shared (more)
    prefill_us_per_token_layer: float = float("nan")


@dataclass
class _Sample:
    ttft_ms: float
    gaps_ms: list[float]
    tokens: int
    stamps: tuple[float, ...] = ()  # perf_counter() of each streamed delta
    prompt_tokens: int = 0  # the prompt's tokens (the answer's stats: context_tokens)


@contextmanager
def service(data_dir: Path, settings: dict[str, str] | None = None) -> Iterator[str]:
    """`python -m app` with its defaults, or `settings` (BLENDSERVE_* names) over them (the sample
    corpus ingested on first start into `data_dir`)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLENDSERVE_")}
    env.update(settings or {})
    env.update({"BLENDSERVE_DATA_DIR": str(data_dir), "BLENDSERVE_SERVICE_PORT": str(port),
                "BLENDSERVE_SERVICE_LOG_LEVEL": "warning", "PYTHONPATH": str(REPO)})
    with app_process(env, data_dir / "server.log", 900) as url:
        _wait_ingested(url)
        yield url


def _wait_ingested(url: str, timeout_s: float = 900) -> None:
    """The first start ingests the sample corpus as a background job (`readyz.ingestion`): wait for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/readyz", timeout=10).json().get("ingestion")
        if job is None or job["status"] in ("done", "failed", "cancelled"):
            return
        time.sleep(2)
    raise TimeoutError("the sample corpus was not ingested in time")


def questions(n: int) -> list[str]:
    """The first n HotpotQA dev questions (the bundled sample corpus holds the paragraphs of the
    first ~40; the rest retrieve their nearest passages from it: RAG prompts all the same)."""
    return [ex.question for ex in load_examples("hotpotqa", n)]


@dataclass(frozen=True)
class _Refused:
    """A 503: the service's queue was full; the client waits `retry_after_s` and asks again."""
    retry_after_s: float
    message: str


async def _one(http: httpx.AsyncClient, url: str, body: dict, t0: float) -> _Sample | _Refused | int:
    """One streamed query asked first at `t0` (its TTFT counts from there, retries included): its
    sample, a 503 to retry, or the HTTP status it failed with."""
    stamps: list[float] = []
    async with http.stream("POST", f"{url}/v1/query", json=body) as r:
        if r.status_code == 503:
            text = (await r.aread()).decode(errors="replace")
            return _Refused(float(r.headers.get("retry-after", "1")), text[:200])
        if r.status_code != 200:
            await r.aread()
            return r.status_code
        event = None
        tokens = prompt = 0
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "delta":
                stamps.append(time.perf_counter())
            elif line.startswith("data: ") and event == "done":
                stats = json.loads(line[6:])["stats"]
                tokens, prompt = stats["completion_tokens"], stats.get("context_tokens", 0)
            elif line.startswith("data: ") and event == "error":
                return 500
    if not stamps:
        return 500
    return _Sample((stamps[0] - t0) * 1e3, [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])], tokens,
                   tuple(stamps), prompt)


async def _asked(http: httpx.AsyncClient, url: str, body: dict, refusals: list[_Refused]) -> _Sample | int:
    """One query as a well-behaved client asks it: each 503 noted in `refusals`, then asked again
    after its Retry-After (MAX_RETRIES times at most; then it counts as refused, 503)."""
    t0 = time.perf_counter()
    for _ in range(MAX_RETRIES + 1):
        result = await _one(http, url, body, t0)
        if not isinstance(result, _Refused):
            return result
        refusals.append(result)
        await asyncio.sleep(result.retry_after_s)
    return 503


def _step_series(name: str, kind: str) -> str:
    """A /metrics series of the engine's steps by kind: name "steps" or "step_seconds", kind decode / prefill."""
    return f'blendserve_engine_{name}_total{{kind="{kind}"}}'


STEP_SERIES = tuple(_step_series(name, kind) for name in ("steps", "step_seconds")
                    for kind in ("decode", "prefill")) + ("blendserve_engine_step_cpu_seconds_total",)
TOKEN_LAYERS = "blendserve_engine_prefill_token_layers_total"


def _grew(first: dict[str, float], last: dict[str, float], name: str) -> float:
    """How much a counter grew between two scrapes (0 where it is absent)."""
    return last.get(name, 0.0) - first.get(name, 0.0)


def _steps(first: dict[str, float], last: dict[str, float]) -> tuple[float, float, float]:
    """Over a level, from two scrapes: mean decode-only and prefill step (ms), and the cores busy meanwhile."""
    def grew(name: str) -> float:
        return _grew(first, last, name)

    def mean_ms(kind: str) -> float:
        n = grew(_step_series("steps", kind))
        return grew(_step_series("step_seconds", kind)) / n * 1e3 if n else float("nan")

    wall = _step_wall(first, last)
    cores = grew("blendserve_engine_step_cpu_seconds_total") / wall if wall else float("nan")
    return mean_ms("decode"), mean_ms("prefill"), cores


def prefill_rate_us(first: dict[str, float], last: dict[str, float]) -> float:
    """Over a level, from two scrapes: microseconds of prefill steps per prefill token-layer."""
    n = _grew(first, last, TOKEN_LAYERS)
    return _grew(first, last, _step_series("step_seconds", "prefill")) / n * 1e6 if n else float("nan")


def _step_wall(first: dict[str, float], last: dict[str, float]) -> float:
    """Seconds the engine spent running steps (decode and prefill) between two scrapes."""
    return sum(_grew(first, last, _step_series("step_seconds", k)) for k in ("decode", "prefill"))


def engine_busy(first: dict[str, float], last: dict[str, float], seconds: float) -> float:
    """The share of a level's `seconds` the engine spent running steps."""
    return _step_wall(first, last) / seconds


def _gauges(text: str) -> dict[str, float]:
    """The engine's pool and batch series from a /metrics scrape."""
    names = ("blendserve_batch_running", "blendserve_kv_pool_blocks", "blendserve_kv_pool_blocks_in_use",
             "blendserve_preemptions_total", "blendserve_prefix_hit_tokens_total", TOKEN_LAYERS, *STEP_SERIES)
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    return out


@dataclass(frozen=True)
class _LevelRun:
    t0: float  # perf_counter() at the level's start
    seconds: float
    full_s: float  # until a client first found the queue empty
    results: list  # _Sample or the failing HTTP status, per request
    refusals: list[_Refused]  # every 503 (each then retried after its Retry-After)
    gauges: list[dict[str, float]]  # /metrics samples, the first before any request, the last after all


async def _level(url: str, bodies: list[dict], clients: int) -> _LevelRun:
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    out: list = []
    samples: list[dict[str, float]] = []
    done = asyncio.Event()
    drained: list[float] = []
    refusals: list[_Refused] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            out.append(await _asked(http, url, queue.get_nowait(), refusals))
        drained.append(time.perf_counter())

    async def poll(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            samples.append(_gauges((await http.get(f"{url}/metrics")).text))
            try:
                await asyncio.wait_for(done.wait(), 0.25)
            except (TimeoutError, asyncio.TimeoutError):
                pass
        samples.append(_gauges((await http.get(f"{url}/metrics")).text))

    async with httpx.AsyncClient(timeout=3600) as http:
        t0 = time.perf_counter()
        poller = asyncio.create_task(poll(http))
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - t0
        done.set()
        await poller
        return _LevelRun(t0, seconds, min(drained) - t0, out, refusals, samples)


def full_tokens_per_s(samples: list[_Sample], t0: float, full_s: float) -> float:
    """Output tokens/s over [t0, t0 + full_s], while every client had a request: each sample's
    tokens spread evenly over its streamed deltas, those up to the end of that window counted."""
    end = t0 + full_s
    tokens = sum(s.tokens * sum(t <= end for t in s.stamps) / len(s.stamps) for s in samples if s.stamps)
    return tokens / full_s if full_s > 0 else float("nan")


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def level_size(clients: int, rounds: int) -> int:
    """Requests at one level: `rounds` per client, at least MIN_REQUESTS."""
    return max(clients * rounds, MIN_REQUESTS)


def measure(url: str, qs: list[str], clients: int, max_tokens: int, rounds: int, natural: bool = False,
            offset: int = 0, n: int | None = None) -> ServingRow:
    """One level of n requests (default `level_size`): its questions are qs[offset:offset + n]
    (wrapping), so that each level asks questions no earlier level asked (`main` moves the offset on)
    and every level sees the same mix: retrieved passages from the store, no exact repeat of an
    earlier prompt (a repeat is a prefix hit: far cheaper, and once made the 1-client level cheaper
    than the rest). With `--same-questions` every level asks the same n instead (`paired_settings`)."""
    n = level_size(clients, rounds) if n is None else n
    bodies = [{"question": qs[(offset + i) % len(qs)], "top_k": 5, "max_tokens": max_tokens, "temperature": 0.0,
               "stream": True, "ignore_eos": not natural} for i in range(n)]
    run = asyncio.run(_level(url, bodies, clients))
    seconds, results, gauges = run.seconds, run.results, run.gauges
    first, last = gauges[0], gauges[-1]

    def peak(name: str) -> int:
        return int(max(g.get(name, 0) for g in gauges))

    def grew(name: str) -> int:
        return int(_grew(first, last, name))

    samples = [r for r in results if isinstance(r, _Sample)]
    gaps = [g for s in samples for g in s.gaps_ms]
    ttft = [s.ttft_ms for s in samples]
    for message in sorted({f.message for f in run.refusals}):
        logger.info("503 (retried after Retry-After): %s", message)
    row = ServingRow(max_tokens, clients, n, len(samples), len(run.refusals) + sum(r == 503 for r in results),
                     sum(isinstance(r, int) and r != 503 for r in results), seconds, len(samples) / seconds,
                     sum(s.tokens for s in samples) / seconds, _pct(ttft, 50), _pct(ttft, 99), _pct(gaps, 50),
                     _pct(gaps, 99), peak("blendserve_batch_running"), peak("blendserve_kv_pool_blocks_in_use"),
                     int(last.get("blendserve_kv_pool_blocks", 0)), grew("blendserve_preemptions_total"),
                     grew("blendserve_prefix_hit_tokens_total"), *_steps(first, last),
                     engine_busy=engine_busy(first, last, seconds),
                     mean_running=_mean([g.get("blendserve_batch_running", 0) for g in gauges[1:-1]]),
                     full_s=run.full_s, full_tokens_per_s=full_tokens_per_s(samples, run.t0, run.full_s),
                     ttft_p95_ms=_pct(ttft, 95), decode_steps=grew(_step_series("steps", "decode")),
                     prefill_steps=grew(_step_series("steps", "prefill")),
                     prompt_tokens=_mean([s.prompt_tokens for s in samples]),
                     answer_tokens=_mean([s.tokens for s in samples]),
                     prefill_us_per_token_layer=prefill_rate_us(first, last))
    logger.info("max_tokens %d, %2d clients: %.3f answers/s, %.1f tokens/s (%.1f while all clients had a request, "
                "%.1f s), TTFT p50 %.0f ms, ITL p50 %.0f ms, 503s %d, peak batch %d, peak pool %d/%d blocks, "
                "%d preemptions, engine busy %.2f", max_tokens, clients, row.answers_per_s, row.tokens_per_s,
                row.full_tokens_per_s, row.full_s, row.ttft_p50_ms, row.itl_p50_ms, row.rejected_503,
                row.peak_running, row.peak_pool_blocks, row.pool_blocks, row.preemptions, row.engine_busy)
    return row


def paired_settings(settings: dict[str, str], n: int, clients: list[int]) -> dict[str, str]:
    """The service's settings for `--same-questions n`: every level asks the same n questions, so
    levels differ in their concurrency only (not in their prompts' and answers' lengths), and automatic
    prefix caching is off, so that no level takes an earlier level's prompts from the pool. A warm-up
    asks the n questions first (8 tokens each), so that every level finds their passages' KV in the same
    tiers (the memory tier; else the first level alone would read them from the disk tier)."""
    if n < max(clients):
        raise SystemExit(f"--same-questions {n} leaves clients idle: it must be at least {max(clients)}")
    if settings.get(PREFIX_CACHING, "false").lower() not in ("false", "0"):
        raise SystemExit(f"--same-questions runs with {PREFIX_CACHING}=false (a level would hit an earlier one)")
    return {**settings, PREFIX_CACHING: "false"}


def table(rows: list[ServingRow]) -> str:
    head = ("| max_tokens | clients | prompt / answer tokens (mean) | answers/s | tokens/s | TTFT p50 / p95 / p99 (ms) "
            "| ITL p50 / p99 (ms) | 503s "
            "| peak batch | peak pool blocks | preemptions | prefix-hit tokens | engine step ms: decode / prefill "
            "| cores busy | engine busy | mean batch | steps: decode / prefill "
            "| tokens/s while all clients had a request (s) | prefill us / token-layer |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r.max_tokens} | {r.clients} | {r.prompt_tokens:,.0f} / {r.answer_tokens:.1f} | {r.answers_per_s:.3f} | "
        f"{r.tokens_per_s:.1f} | "
        f"{r.ttft_p50_ms:,.0f} / {r.ttft_p95_ms:,.0f} / {r.ttft_p99_ms:,.0f} | {r.itl_p50_ms:,.0f} / {r.itl_p99_ms:,.0f} | "
        f"{r.rejected_503} | {r.peak_running} | {r.peak_pool_blocks} / {r.pool_blocks} | {r.preemptions} | "
        f"{r.prefix_hit_tokens:,} | {r.decode_step_ms:,.0f} / {r.prefill_step_ms:,.0f} | {r.step_cores:.2f} | "
        f"{r.engine_busy:.2f} | {r.mean_running:.1f} | {r.decode_steps} / {r.prefill_steps} | "
        f"{r.full_tokens_per_s:.1f} ({r.full_s:.1f}) | {r.prefill_us_per_token_layer:.0f} |\n"
        for r in rows)


def scaling(rows: list[ServingRow], natural: bool) -> str:
    """Per max_tokens: each level's tokens/s over one client's, and 16 clients' over 8's, beside issue #35's
    goals (8 / 1 >= 2.5x with natural lengths, >= 3x fixed; 16 / 8 >= 1.3x). Empty without a 1-client level."""
    lines = []
    for mt in dict.fromkeys(r.max_tokens for r in rows):
        rate = {r.clients: r.tokens_per_s for r in rows if r.max_tokens == mt}
        if 1 not in rate:
            continue
        over = ", ".join(f"{c} clients {rate[c] / rate[1]:.2f}x" for c in sorted(rate) if c > 1)
        line = f"max_tokens {mt}: tokens/s over one client's: {over or 'no other level'}"
        if 8 in rate:
            line += f" (8 / 1 goal {'2.5' if natural else '3'}x)"
        if 8 in rate and 16 in rate:
            line += f"; 16 / 8 {rate[16] / rate[8]:.2f}x (goal 1.3x)"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[ServingRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mt in sorted({r.max_tokens for r in rows}):
        sel = [r for r in rows if r.max_tokens == mt]
        x = [r.clients for r in sel]
        axes[0].plot(x, [r.tokens_per_s for r in sel], marker="o", label=f"max_tokens {mt}")
        axes[1].plot(x, [r.answers_per_s for r in sel], marker="o", label=f"max_tokens {mt}")
        axes[2].plot(x, [r.itl_p50_ms for r in sel], marker="o", label=f"max_tokens {mt}")
    for ax, title in zip(axes, ("output tokens/s", "answers/s", "inter-token latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,2,4,8,16")
    p.add_argument("--max-tokens", default="32,128")
    p.add_argument("--rounds", type=int, default=2, help="requests per client at each level (at least 4 in all)")
    p.add_argument("--questions", type=int, default=200,
                   help="HotpotQA dev questions to draw from; a level's questions are new unless they run out")
    p.add_argument("--data-dir", type=Path, default=None, help="reuse an ingested data dir (default: a temporary one)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--natural", action="store_true", help="answers end at EOS (natural lengths), max_tokens a cap")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a BLENDSERVE_* setting for the service (repeatable), e.g. BLENDSERVE_ENGINE_MAX_BATCH=16")
    p.add_argument("--same-questions", type=int, default=0, metavar="N",
                   help="paired levels: every level asks the same N questions (--rounds unused), automatic "
                        "prefix caching off so that no level hits an earlier one's prompts")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    qs = questions(args.questions)
    levels = [(int(mt), int(c)) for mt in args.max_tokens.split(",") for c in args.clients.split(",")]
    settings = dict(kv.split("=", 1) for kv in args.set)
    same = args.same_questions
    if same:
        settings = paired_settings(settings, same, [c for _, c in levels])
    asked = same or sum(level_size(c, args.rounds) for _, c in levels)
    if asked > len(qs) - WARMUP:
        logger.warning("%d requests over %d questions: later levels will repeat earlier questions (prefix hits); "
                       "pass --questions %d", asked, len(qs) - WARMUP, asked + WARMUP)
    rows: list[ServingRow] = []
    with tempfile.TemporaryDirectory(prefix="blendserve-serving-") as tmp:
        data_dir = args.data_dir or Path(tmp)
        data_dir.mkdir(parents=True, exist_ok=True)
        with service(data_dir, settings) as url:
            measure(url, qs[-WARMUP:], 1, 8, 1)  # warm-up: the passages' KV is cached at ingestion, this warms the rest
            if same:  # and every level's passages: the first level would otherwise load them from disk for the rest
                measure(url, qs[:same], min(8, same), 8, 1, n=same)
            offset = 0
            for mt, clients in levels:
                rows.append(measure(url, qs[:-WARMUP], clients, mt, args.rounds, args.natural, offset, same or None))
                offset += 0 if same else level_size(clients, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    (args.out / "serving.md").write_text(table(rows))
    plot(rows, args.out / "serving.png")
    print(table(rows))
    print(scaling(rows, args.natural))


if __name__ == "__main__":
    main()
