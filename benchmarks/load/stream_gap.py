"""Stream gaps under reranked arrivals (issue #56 item 5): does a streaming answer's inter-token gap
grow while other clients submit questions that are retrieved and reranked?

Retrieval, the cross-encoder rerank, tokenizing and block hashing run on worker threads, not on the
event loop (`app.service.QueryRun`), so a stream's deltas should keep coming while other requests
retrieve. This measures it as a client sees it, over HTTP, against `python -m app` started here (a
temporary data dir, no sample corpus, fidelity gate off, a free port):

1. a CrossEncoder of the real `cross-encoder/ms-marco-MiniLM-L-6-v2` shape (BERT, 6 layers, hidden 384,
   12 heads, intermediate 1536, one label) with **random weights** (nothing is downloaded: its scores
   are meaningless, its cost is the real model's) and the bundled embedder's tokenizer is saved to a
   temporary folder and named by `BLENDSERVE_RETRIEVAL_RERANKER`;
2. the paragraphs of the first HotpotQA dev examples are ingested through `POST /v1/documents`
   (`--examples 5`: 50 passages, as many as the reranker's candidate depth, so every rerank scores 50);
3. *quiet*: one client streams `/v1/query` (retrieved, top_k 5, `ignore_eos`, `--max-tokens` tokens),
   `--streams` times one after another, and stamps every SSE `delta` event as it arrives; the gaps
   between consecutive deltas of all streams are pooled: p50 / p90 / p99 / max;
4. *loaded*: the same streams while `--clients` other clients keep posting reranked questions
   (`/v1/query`, top_k 5, `max_tokens` 1), each waiting for its answer before asking again; the
   streams start once every one of them has had an answer (their prompts are then in the KV pool);
   same statistics, plus the loaded requests answered and their median latency.

Beside each row: a probe's `GET /healthz` latency (an `async def` route that does nothing: what the
event loop alone adds) and, from `/metrics`, the engine's mean decode-only step and its steps that
carried prefill rows during the streams (what the engine loop did meanwhile). By default each loaded
client asks its own question again and again (`--load-questions` = clients): retrieval and rerank run
every time (nothing caches them) while the engine only finishes a prompt it holds (a prefix hit of the
last block), so the load is host work; `--load-questions 200` asks new questions instead, adding a
blend prefill per arrival. `--control` restarts the service on the same data without the reranker and
measures both rows again (the same arrivals' retrieval without the rerank's CPU), to separate the
event loop from two cores shared with the rerank threads.

Target (issue #56): loaded gap p99 within 1.2x of the quiet one. Results: benchmarks/results/stream_gap.json.

    python -m benchmarks.load.stream_gap [--clients 8] [--streams 5] [--max-tokens 64] [--quick] [--control]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common.client_gc import no_gc_pauses
from benchmarks.common.data import Example, load_examples
from benchmarks.common.service import REPO, app_process, free_port
from benchmarks.load.serving import _gauges, _grew, _step_series
from benchmarks.peers.peer_vllm import cpu_model
from retrieval.lexical import CANDIDATES

logger = logging.getLogger(__name__)
OUT = REPO / "benchmarks" / "results" / "stream_gap.json"
TARGET = 1.2  # loaded gap p99 over quiet gap p99 (issue #56)
TOP_K = 5
PROBE_INTERVAL_S = 0.05
STORE_QUEUED = "blendserve_kv_store_queued"
MAX_RETRIES = 30  # 503s a stream takes before the benchmark gives up
LONG_GAP_MS = 100.0  # gaps listed with their time (`Row.long_gaps`)
# cross-encoder/ms-marco-MiniLM-L-6-v2's shape (its config.json), random weights
CROSS_ENCODER_SHAPE = {"vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
                       "intermediate_size": 1536, "max_position_embeddings": 512, "num_labels": 1}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


# ====================================================================== pure parts (tests/benchmarks/test_stream_gap.py)
@dataclass(frozen=True)
class GapStats:
    """Inter-delta gaps pooled over streams, in milliseconds."""

    n: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, gaps_ms: list[float]) -> GapStats:
        if not gaps_ms:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan)
        p50, p90, p99 = (float(v) for v in np.percentile(gaps_ms, [50, 90, 99]))
        return cls(len(gaps_ms), p50, p90, p99, float(max(gaps_ms)))


def gaps_ms(stamps: list[float]) -> list[float]:
    """Gaps between consecutive arrival times (seconds) in ms: n stamps give n - 1 gaps."""
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]


def pooled_gaps(streams: list[list[float]]) -> list[float]:
    """Every stream's gaps, pooled (a gap never spans two streams)."""
    return [g for stamps in streams for g in gaps_ms(stamps)]


def long_gaps(streams: list[list[float]], wall_offset: float, over_ms: float = LONG_GAP_MS) -> list[tuple[str, float]]:
    """The gaps over `over_ms`: (local wall-clock time of the delta that ended it, to the millisecond;
    the gap in ms), to find in the service's log. `wall_offset`: time.time() - time.perf_counter()."""
    out = []
    for stamps in streams:
        for a, b in zip(stamps, stamps[1:]):
            if (b - a) * 1e3 > over_ms:
                end = b + wall_offset
                out.append((time.strftime("%H:%M:%S", time.localtime(end)) + f".{int(end * 1e3) % 1000:03d}",
                            round((b - a) * 1e3, 1)))
    return out


class SseParser:
    """Server-sent events, line by line: `feed` returns (event, data) when a blank line ends an event
    (event "message" when none was named; several data lines joined by newlines), else None."""

    def __init__(self) -> None:
        self._event: str | None = None
        self._data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        line = line.rstrip("\r\n")
        if not line:
            if not self._data and self._event is None:
                return None
            out = (self._event or "message", "\n".join(self._data))
            self._event, self._data = None, []
            return out
        if line.startswith(":"):  # a comment
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None


def ratio(loaded: float, quiet: float) -> float:
    return loaded / quiet if quiet > 0 else float("nan")


# ====================================================================== the service
def build_cross_encoder(folder: Path, seed: int = 0) -> Path:
    """A random-weight CrossEncoder of ms-marco-MiniLM-L-6-v2's shape, with the bundled embedder's
    tokenizer (the same BERT uncased vocabulary), saved to `folder`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from retrieval.embedder import bundled_model_dir

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    BertForSequenceClassification(BertConfig(**CROSS_ENCODER_SHAPE)).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(bundled_model_dir() / name, folder / name)
    return folder


@contextmanager
def service(data_dir: Path, reranker: Path | None, port: int, settings: dict[str, str]) -> Iterator[str]:
    """`python -m app` on `port` over `data_dir`, reranking with `reranker` (None: no reranker)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLENDSERVE_")}
    env.update({"BLENDSERVE_DATA_DIR": str(data_dir), "BLENDSERVE_INGEST_SAMPLE_ON_START": "false",
                "BLENDSERVE_ENGINE_FIDELITY_GATE": "off", "BLENDSERVE_SERVICE_HOST": "127.0.0.1",
                "BLENDSERVE_SERVICE_PORT": str(port), "BLENDSERVE_SERVICE_LOG_LEVEL": "warning",
                "BLENDSERVE_SERVICE_REQUEST_TIMEOUT_S": "3600", "BLENDSERVE_RETRIEVAL_RERANKER": str(reranker or ""),
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
                **settings})
    with app_process(env, data_dir / "server.log", 600) as url:
        yield url


def ingest(url: str, examples: list[Example]) -> int:
    """Every paragraph of `examples` through POST /v1/documents (one request per example); passages stored."""
    passages = 0
    for ex in examples:
        docs = [{"text": p.text, "title": p.title, "doc_id": f"{ex.id}-{i}"} for i, p in enumerate(ex.paragraphs)]
        r = httpx.post(f"{url}/v1/documents", json={"documents": docs}, timeout=600)
        r.raise_for_status()
        passages += r.json()["passages"]
    return passages


def query_body(question: str, max_tokens: int, stream: bool) -> dict:
    return {"question": question, "top_k": TOP_K, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}


# ====================================================================== clients
@dataclass
class Stream:
    stamps: list[float]  # perf_counter() of each `delta` event
    ttft_ms: float
    tokens: int


async def stream_once(http: httpx.AsyncClient, url: str, body: dict) -> Stream:
    """One streamed query: the arrival time of each `delta` event (raises on an HTTP or in-band error)."""
    t0 = time.perf_counter()
    for _ in range(MAX_RETRIES):
        stream = await _streamed(http, url, body, t0)
        if isinstance(stream, Stream):
            return stream
        await asyncio.sleep(stream)
    raise RuntimeError(f"stream: refused {MAX_RETRIES} times")


async def _streamed(http: httpx.AsyncClient, url: str, body: dict, t0: float) -> Stream | float:
    """One try: the stream, or the Retry-After of a 503 (refused at admission)."""
    stamps: list[float] = []
    tokens = 0
    parser = SseParser()
    async with http.stream("POST", f"{url}/v1/query", json=body) as r:
        if r.status_code == 503:
            await r.aread()
            return float(r.headers.get("retry-after", "1"))
        if r.status_code != 200:
            raise RuntimeError(f"stream: HTTP {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            event = parser.feed(line)
            if event is None:
                continue
            kind, data = event
            if kind == "delta":
                stamps.append(time.perf_counter())
            elif kind == "done":
                tokens = json.loads(data)["stats"]["completion_tokens"]
            elif kind == "error":
                raise RuntimeError(f"stream: in-band error {data[:300]}")
    if not stamps:
        raise RuntimeError("stream: no delta")
    return Stream(stamps, (stamps[0] - t0) * 1e3, tokens)


@dataclass
class Load:
    """What the loaded clients did: answer latencies (ms), when each was answered, errors."""

    latencies_ms: list[float] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    refused: int = 0  # 503s (asked again after Retry-After)
    first: dict[int, float] = field(default_factory=dict)  # client -> its first answer's time


async def load_client(http: httpx.AsyncClient, url: str, i: int, bodies: list[dict], clients: int,
                      stop: asyncio.Event, load: Load) -> None:
    """Client i asks bodies i, i + clients, ... (wrapping) until `stop`, each after the last is answered."""
    k = 0
    while not stop.is_set():
        body = bodies[(i + k * clients) % len(bodies)]
        k += 1
        t0 = time.perf_counter()
        try:
            r = await http.post(f"{url}/v1/query", json=body)
            if r.status_code == 503:
                load.refused += 1
                k -= 1  # the same question again
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                continue
            r.raise_for_status()
        except httpx.HTTPError as exc:
            load.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(1.0)
            continue
        now = time.perf_counter()
        load.latencies_ms.append((now - t0) * 1e3)
        load.answered_at.append(now)
        load.first.setdefault(i, now)


async def probe(http: httpx.AsyncClient, url: str, stop: asyncio.Event, out: list[float]) -> None:
    """GET /healthz every PROBE_INTERVAL_S until `stop`: each answer's latency (ms)."""
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await http.get(f"{url}/healthz")
        if r.status_code == 200:
            out.append((time.perf_counter() - t0) * 1e3)
        await asyncio.sleep(PROBE_INTERVAL_S)


def _metrics(url: str) -> dict[str, float]:
    return _gauges(httpx.get(f"{url}/metrics", timeout=60).text)


@dataclass(frozen=True)
class Row:
    """One phase: the streams' pooled gaps and what happened beside them."""

    name: str
    reranker: bool
    clients: int
    streams: int
    gaps: GapStats
    ttft_ms: list[float]
    tokens: list[int]
    seconds: float  # from the first stream's start to the last one's end
    probe: GapStats  # /healthz latencies during the streams (GapStats' fields: p50 / p90 / p99 / max)
    decode_step_ms: float  # the engine's mean decode-only step during the streams
    decode_steps: int
    prefill_steps: int  # steps carrying prefill rows during the streams
    prefill_step_ms: float
    loaded_answered: int = 0  # loaded requests answered during the streams
    loaded_answered_all: int = 0  # ... during the whole phase (warm round and drain included)
    loaded_latency_p50_ms: float = float("nan")  # median over the phase
    loaded_errors: int = 0
    loaded_refused: int = 0  # 503s the loaded clients got (each asked again after Retry-After)
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)  # at the phase's end
    load_average_start: tuple[float, float, float] = (0.0, 0.0, 0.0)
    started: str = ""  # local time of the first stream's start
    long_gaps: tuple[tuple[str, float], ...] = ()  # gaps over LONG_GAP_MS: (local time of their end, ms)


def _engine(first: dict[str, float], last: dict[str, float]) -> dict:
    def grew(name: str) -> float:
        return _grew(first, last, name)

    def mean_ms(kind: str) -> float:
        n = grew(_step_series("steps", kind))
        return grew(_step_series("step_seconds", kind)) / n * 1e3 if n else float("nan")

    return {"decode_step_ms": mean_ms("decode"), "decode_steps": int(grew(_step_series("steps", "decode"))),
            "prefill_steps": int(grew(_step_series("steps", "prefill"))), "prefill_step_ms": mean_ms("prefill")}


async def phase(url: str, name: str, reranker: bool, stream_bodies: list[dict], load_bodies: list[dict],
                clients: int) -> Row:
    """The streams one after another, with `clients` loaded clients asking `load_bodies` meanwhile (0: quiet)."""
    stop_load, stop_probe = asyncio.Event(), asyncio.Event()
    load, probes = Load(), []
    async with httpx.AsyncClient(timeout=600) as http:
        tasks = [asyncio.create_task(load_client(http, url, i, load_bodies, clients, stop_load, load))
                 for i in range(clients)]
        while len(load.first) < clients:  # every client answered once: its prompt is in the pool, reranks in flight
            if all(t.done() for t in tasks):
                break
            if len(load.errors) > 4 * clients:
                raise RuntimeError(f"loaded clients fail: {load.errors[:3]}")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0 if clients else 0.0)
        before = await asyncio.to_thread(_metrics, url)
        prober = asyncio.create_task(probe(http, url, stop_probe, probes))
        t0, started, load_start = time.perf_counter(), time.strftime("%H:%M:%S"), os.getloadavg()
        wall_offset = time.time() - t0
        streams = [await stream_once(http, url, b) for b in stream_bodies]
        t1 = time.perf_counter()
        stop_probe.set()
        await prober
        after = await asyncio.to_thread(_metrics, url)
        stop_load.set()
        await asyncio.gather(*tasks)  # each finishes the request it has in flight
    during = sum(t0 <= t <= t1 for t in load.answered_at)
    lat = statistics.median(load.latencies_ms) if load.latencies_ms else float("nan")
    row = Row(name, reranker, clients, len(streams), GapStats.of(pooled_gaps([s.stamps for s in streams])),
              [round(s.ttft_ms, 1) for s in streams], [s.tokens for s in streams], t1 - t0, GapStats.of(probes),
              **_engine(before, after), loaded_answered=during, loaded_answered_all=len(load.latencies_ms),
              loaded_latency_p50_ms=lat, loaded_errors=len(load.errors), loaded_refused=load.refused,
              load_average=os.getloadavg(), load_average_start=load_start, started=started,
              long_gaps=tuple(long_gaps([s.stamps for s in streams], wall_offset)))
    logger.info("%s: gaps p50 %.1f p99 %.1f max %.1f ms (%d), /healthz p99 %.1f ms, decode step %.1f ms, "
                "%d prefill steps, loaded answered %d (median %.0f ms), load %.2f; gaps over %.0f ms: %s", name,
                row.gaps.p50_ms, row.gaps.p99_ms, row.gaps.max_ms, row.gaps.n, row.probe.p99_ms, row.decode_step_ms,
                row.prefill_steps, during, lat, row.load_average[0], LONG_GAP_MS,
                ", ".join(f"{ms:.0f} ms at {at}" for at, ms in row.long_gaps) or "none")
    return row


def measure(url: str, reranker: bool, stream_bodies: list[dict], load_bodies: list[dict], clients: int,
            suffix: str = "") -> list[Row]:
    """Every prompt once (`warm`), then the quiet and the loaded row."""
    warm(url, [*stream_bodies, *load_bodies])
    with no_gc_pauses():  # the client's own collector must not stall the stamps it takes
        quiet = asyncio.run(phase(url, f"quiet{suffix}", reranker, stream_bodies, load_bodies, 0))
    with no_gc_pauses():
        loaded = asyncio.run(phase(url, f"loaded{suffix}", reranker, stream_bodies, load_bodies, clients))
    return [quiet, loaded]


def warm(url: str, bodies: list[dict], timeout_s: float = 900) -> None:
    """Ask every prompt once (one token), one after another, then wait until the engine loop stored
    the passages they missed (`blendserve_kv_store_queued` 0): both rows then find the same prompts in
    the KV pool, and neither shares the loop with that background work."""
    for body in bodies:
        httpx.post(f"{url}/v1/query", json={**body, "max_tokens": 1, "stream": False}, timeout=600).raise_for_status()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stored(httpx.get(f"{url}/metrics", timeout=60).text):
            return
        time.sleep(1.0)
    logger.warning("background storing still queued after %.0f s", timeout_s)


def stored(metrics: str) -> bool:
    """No missed passage waits for storing in a /metrics scrape (absent: nothing to wait for)."""
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name == STORE_QUEUED:
            return float(value) == 0
    return True


# ====================================================================== report
def table(rows: list[Row]) -> str:
    head = ("| row | reranker | clients | gaps | gap p50 / p90 / p99 / max (ms) | /healthz p50 / p99 (ms) "
            "| decode step (ms) | prefill steps | loaded answered (median ms) | stream TTFT (ms) | load |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r.name} | {'on' if r.reranker else 'off'} | {r.clients} | {r.gaps.n} | {r.gaps.p50_ms:.1f} / "
        f"{r.gaps.p90_ms:.1f} / {r.gaps.p99_ms:.1f} / {r.gaps.max_ms:.1f} | {r.probe.p50_ms:.1f} / {r.probe.p99_ms:.1f} "
        f"| {r.decode_step_ms:.1f} | {r.prefill_steps} | "
        + (f"{r.loaded_answered} ({r.loaded_latency_p50_ms:,.0f})" if r.clients else "-")
        + f" | {statistics.median(r.ttft_ms):,.0f} | {r.load_average[0]:.2f} |\n"
        for r in rows)


def verdicts(rows: list[Row]) -> list[str]:
    """Per quiet / loaded pair: the loaded gap p99 over the quiet one against TARGET."""
    out = []
    by_name = {r.name: r for r in rows}
    for r in rows:
        if not r.name.startswith("loaded"):
            continue
        quiet = by_name.get("quiet" + r.name[len("loaded"):])
        if quiet is None:
            continue
        x = ratio(r.gaps.p99_ms, quiet.gaps.p99_ms)
        out.append(f"{r.name} (reranker {'on' if r.reranker else 'off'}): gap p99 {r.gaps.p99_ms:.1f} ms / quiet "
                   f"{quiet.gaps.p99_ms:.1f} ms = {x:.2f}x (target <= {TARGET}x: {'met' if x <= TARGET else 'NOT met'});"
                   f" p50 {ratio(r.gaps.p50_ms, quiet.gaps.p50_ms):.2f}x")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load.stream_gap", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8, help="loaded clients beside the stream")
    p.add_argument("--streams", type=int, default=5, help="streams per row, one after another")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (ignore_eos)")
    p.add_argument("--examples", type=int, default=5, help="HotpotQA dev examples whose paragraphs are ingested")
    p.add_argument("--load-questions", type=int, default=0,
                   help="questions the loaded clients cycle over (default: one each, asked again and again: "
                        "rerank every time, a prefix hit in the engine); more asks new ones (a blend each)")
    p.add_argument("--port", type=int, default=0, help="the service's port (default: a free one)")
    p.add_argument("--control", action="store_true",
                   help="also restart without the reranker on the same data and measure both rows again")
    p.add_argument("--quick", action="store_true", help="a short run: 2 streams of 32 tokens")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a BLENDSERVE_* setting (repeatable)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--server-log", type=Path, default=None, help="copy the service's output here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.quick:
        args.streams, args.max_tokens = min(args.streams, 2), min(args.max_tokens, 32)
    settings = dict(kv.split("=", 1) for kv in args.set)
    n_load = args.load_questions or args.clients
    examples = load_examples("hotpotqa", max(args.examples, args.streams) + n_load)
    corpus = examples[:args.examples]
    stream_bodies = [query_body(ex.question, args.max_tokens, True) for ex in examples[:args.streams]]
    load_bodies = [query_body(ex.question, 1, False) for ex in examples[-n_load:]]
    port = args.port or free_port()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_at_start = os.getloadavg()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="blendserve-stream-gap-") as tmp:
        folder = build_cross_encoder(Path(tmp) / "cross-encoder")
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        with service(data_dir, folder, port, settings) as url:
            passages = ingest(url, corpus)
            logger.info("ingested %d passages from %d examples", passages, len(corpus))
            rows += measure(url, True, stream_bodies, load_bodies, args.clients)
        if args.control:
            with service(data_dir, None, port, settings) as url:
                rows += measure(url, False, stream_bodies, load_bodies, args.clients, suffix=" (no rerank)")
        if args.server_log is not None:
            shutil.copyfile(data_dir / "server.log", args.server_log)
    result = {
        "question": "stream gap p99 under reranked arrivals, within 1.2x of a quiet stream's (issue #56 item 5)",
        "started": started, "host": {"cpu": cpu_model(), "nproc": os.cpu_count(), "load_average_at_start": load_at_start},
        "reranker": {"shape": CROSS_ENCODER_SHAPE, "weights": "random (timing only: the scores mean nothing)",
                     "candidates_per_rerank": min(passages, CANDIDATES)},
        "settings": {"clients": args.clients, "streams": args.streams, "max_tokens": args.max_tokens, "top_k": TOP_K,
                     "examples": args.examples, "passages": passages, "load_questions": n_load, "quick": args.quick,
                     "service": settings},
        "target": TARGET, "rows": [asdict(r) for r in rows], "verdicts": verdicts(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("Reranker: random weights of ms-marco-MiniLM-L-6-v2's shape (timing only).")
    print(table(rows))
    print("\n".join(verdicts(rows)))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
