"""The GPU check's batched run (`gpu_check` part 4): 1, 16 and 64 concurrent requests on the engine
loop (continuous batching), each blending ~8K tokens (its own passages' KV in pinned RAM, ratio
0.15) and decoding `max_tokens` tokens through end-of-sequence. Per level: answers/s, output
tokens/s, p50/p99 TTFT and inter-token latency, and how many requests were decoding at once.

Only the engine's public API is used (issue #39: the batching engine is being replaced, #35):
`BlendEngine.generate` from one thread per request, `Generation.deltas()`, `close()`. How many
requests ran together is read off the clients' own token timestamps (`max_in_flight`: the most
requests between their first and last token at one instant), not the loop's internals. The one
engine-specific setting is the batch limit (`_config`)."""

from __future__ import annotations

import threading
import time

import numpy as np

from benchmarks.gpu.gpu_common import QUESTIONS, Setup, cache_kv, kv_format, make_passages, pinned_store
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig


def time_batched(setup: Setup, runner: ModelRunner, clients: tuple[int, ...], n_tokens: int,
                 max_tokens: int = 32, n_contexts: int = 4, decode_graphs: str = "auto") -> dict:
    """`n_contexts` different ~n_tokens contexts (their KV cached in pinned RAM), requests cycling over
    them with different questions, `c` at once for each c in `clients`; `decode_graphs` as
    `EngineConfig.decode_graphs` (auto: decode steps replayed as CUDA graphs on CUDA)."""
    engine, plans, gen = batched_engine(setup, runner, max(clients), n_tokens, max_tokens, n_contexts, decode_graphs)
    rows = [run_level(engine, plans[:c], gen) for c in clients]
    captured = engine.loop.stats()["decode_graphs"]
    engine.close()
    return {"tokens": engine.layout(plans[0]).n_tokens, "max_tokens": max_tokens, "decode_graphs": decode_graphs,
            "graphs_captured": captured, "rows": rows}


Batch = tuple[BlendEngine, list[BlendPlan], GenerationConfig]


def batched_engine(setup: Setup, runner: ModelRunner, clients: int, n_tokens: int, max_tokens: int = 32,
                   n_contexts: int = 4, decode_graphs: str = "auto") -> Batch:
    """The batched run's engine (admitting `clients` requests at once, warmed up by one short request),
    `clients` plans cycling over `n_contexts` contexts of ~n_tokens (KV in pinned RAM) with different
    questions, and the generation settings (`max_tokens`, end-of-sequence ignored). Close the engine."""
    fmt, dt = kv_format(runner)
    store = pinned_store(setup, dt)
    engine = BlendEngine(runner, store, _config(fmt, runner, clients, n_tokens + max_tokens, decode_graphs))
    contexts = [make_passages(engine, n_tokens - 64, seed=100 + i) for i in range(n_contexts)]
    for passages in contexts:
        cache_kv(engine, passages, [store])
    plans = [BlendPlan(tuple(contexts[i % n_contexts]), QUESTIONS[i % len(QUESTIONS)], recompute_ratio=0.15)
             for i in range(clients)]
    engine.run(plans[0], GenerationConfig(max_tokens=2))  # warm-up (kernels, allocator)
    return engine, plans, GenerationConfig(max_tokens=max_tokens, ignore_eos=True)


KV_SLACK = 1.25  # the batch's KV budget over what its requests need (block rounding, prefill chunks)


def _config(fmt: str, runner: ModelRunner, clients: int, tokens_per_request: int,
            decode_graphs: str = "auto") -> EngineConfig:
    """The engine configured to admit `clients` requests of `tokens_per_request` tokens at once, its KV
    budget what they need (the paged pool of #35 allocates its whole budget on the device: never a
    blanket limit). The one place that names the batching engine's limits."""
    from blend_engine.scheduler.batch import BatchLimits

    s = runner.shape
    per_token = 2 * s.n_layers * s.n_kv_heads * s.head_dim * runner.dtype.itemsize  # K and V, every layer
    budget = int(KV_SLACK * clients * tokens_per_request * per_token)
    return EngineConfig(kv_format=fmt, batch=BatchLimits(max_batch=clients, kv_budget_bytes=budget),
                        decode_graphs=decode_graphs)


def run_level(engine: BlendEngine, plans: list[BlendPlan], gen: GenerationConfig) -> dict:
    """The plans at once, one client thread each, timed from a common start: throughput, TTFT, ITL."""
    stamps: list[list[float]] = [[] for _ in plans]
    start = threading.Barrier(len(plans) + 1)

    def one(i: int) -> None:
        g = engine.generate(plans[i], gen)
        start.wait()
        for _ in g.deltas():
            stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    ttft = [s[0] - t0 for s in stamps if s]
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:])]
    tokens = sum(len(s) for s in stamps)
    return {"clients": len(plans), "seconds": seconds, "answers_per_s": len(plans) / seconds,
            "tokens_per_s": tokens / seconds, "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(gaps, 50), "itl_p99_ms": _pct(gaps, 99), "max_in_flight": max_in_flight(stamps)}


def max_in_flight(stamps: list[list[float]]) -> int:
    """The most requests decoding at one instant: between their first and last token, both included."""
    edges = sorted([(s[0], 0) for s in stamps if s] + [(s[-1], 1) for s in stamps if s])  # starts sort before ends
    best = now = 0
    for _, end in edges:
        now += -1 if end else 1
        best = max(best, now)
    return best


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")

