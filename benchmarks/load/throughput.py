"""Throughput of the running service: N concurrent clients posting /v1/query, blend vs full prefill."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common.data import Example, select_paragraphs
from benchmarks.common.service import app_process, free_port

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThroughputRow:
    mode: str
    clients: int
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    mean_context_tokens: float


@contextmanager
def running_service(workers: int | None = None, threads: int | None = None, ready_timeout_s: float = 300.0,
                    keep_log: Path | None = None) -> Iterator[str]:
    """`python -m app` on a free local port with a temporary data dir; yields its base URL.
    `workers` (request threads) and `threads` (torch's) keep the service's defaults when None.

    The server's output (warnings and errors) is copied to `keep_log` when given.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="blendbench-svc-") as tmp:
        env = {**os.environ, "BLENDSERVE_DATA_DIR": tmp, "BLENDSERVE_INGEST_SAMPLE_ON_START": "false",
               "BLENDSERVE_SERVICE_PORT": str(port), "BLENDSERVE_SERVICE_HOST": "127.0.0.1",
               "BLENDSERVE_SERVICE_MAX_QUEUE": "256",
               "BLENDSERVE_SERVICE_REQUEST_TIMEOUT_S": "3600", "BLENDSERVE_SERVICE_LOG_LEVEL": "warning",
               **({"BLENDSERVE_SERVICE_WORKERS": str(workers)} if workers else {}),
               **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        try:
            with app_process(env, Path(tmp) / "server.log", ready_timeout_s) as url:
                yield url
        finally:
            if keep_log is not None:
                shutil.copyfile(Path(tmp) / "server.log", keep_log)


def request_bodies(examples: list[Example], max_paragraphs: int | None, max_tokens: int) -> list[dict]:
    """One /v1/query body per example, documents in the dataset's order."""
    return [{"question": ex.question, "max_tokens": max_tokens, "temperature": 0.0,
             "documents": [{"title": p.title, "text": p.text} for p in select_paragraphs(ex, max_paragraphs)]}
            for ex in examples]


async def _client(http: httpx.AsyncClient, url: str, queue: asyncio.Queue, lat: list[float], ctx: list[int],
                  errors: list[str]) -> None:
    while True:
        try:
            body = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        t0 = time.perf_counter()
        try:
            r = await http.post(f"{url}/v1/query", json=body)
            r.raise_for_status()
            lat.append((time.perf_counter() - t0) * 1e3)
            ctx.append(r.json()["stats"]["context_tokens"])
        except httpx.HTTPError as exc:
            errors.append(str(exc))


async def _load(url: str, bodies: list[dict], clients: int) -> tuple[float, list[float], list[int], list[str]]:
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    lat: list[float] = []
    ctx: list[int] = []
    errors: list[str] = []
    async with httpx.AsyncClient(timeout=3600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(http, url, queue, lat, ctx, errors) for _ in range(clients)))
        return time.perf_counter() - t0, lat, ctx, errors


def measure(url: str, bodies: list[dict], mode: str, clients: int, ratio: float | None = 0.15) -> ThroughputRow:
    sent = [{**b, "mode": mode, **({"recompute_ratio": ratio} if mode == "blend" else {})} for b in bodies]
    seconds, lat, ctx, errors = asyncio.run(_load(url, sent, clients))
    if errors:
        logger.warning("%d/%d %s requests failed, first: %s", len(errors), len(sent), mode, errors[0])
    lat_arr = np.asarray(lat or [float("nan")])
    return ThroughputRow(mode, clients, len(sent), len(errors), seconds, len(lat) / seconds,
                         float(np.percentile(lat_arr, 50)), float(np.percentile(lat_arr, 99)),
                         float(np.mean(ctx)) if ctx else 0.0)


def run_throughput(examples: list[Example], clients: int, max_paragraphs: int | None = None, max_tokens: int = 8,
                   workers: int | None = None, threads: int | None = None,
                   keep_log: Path | None = None) -> list[ThroughputRow]:
    """Warm the KV store with one sequential blend pass, then blend and full prefill under `clients` clients."""
    bodies = request_bodies(examples, max_paragraphs, max_tokens)
    with running_service(workers, threads, keep_log=keep_log) as url:
        warm = measure(url, bodies, "blend", 1)
        logger.info("throughput warm-up pass: %.1f s, %d errors", warm.seconds, warm.errors)
        rows = [measure(url, bodies, mode, clients) for mode in ("blend", "full_prefill")]
    for r in rows:
        logger.info("throughput %s: %.3f req/s, p50 %.0f ms, p99 %.0f ms", r.mode, r.rps, r.p50_ms, r.p99_ms)
    return rows
