"""KV store benchmark: time to first token of blend@0.15 with caches in RAM, on local disk, in Redis,
and per layer (issue #57 item 2): the load, how long compute waited for it, the compute, and the share
of layers where compute waited.

Contexts of ~4K tokens are built from real MuSiQue passages (paragraph_text, title). Every tier
is measured on its own (the memory tier above disk/Redis gets a zero budget so every read really
comes from the tier under test). Disk reads may be served from the OS page cache: dropping it
needs root. Also: stored bytes per token for fp16 and int8, and the KL cost of int8 against fp16
on the first-token distribution.

    python -m benchmarks.kv_delivery.store [--contexts 1] [--tokens 4000] [--trials 3] [--redis-url URL]   (make bench-store)

Functions: `build_contexts`, `measure_tiers`, `measure_formats`, `run`.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common.data import Context, build_context, load_examples
from benchmarks.common.scoring import kl
from benchmarks.common.service import free_port
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.keys import store_fingerprint
from blend_engine.kv_store import ChunkKV, KVStore
from blend_engine.kv_store.codec import encode_chunk
from blend_engine.kv_store.factory import build_loader, build_store
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig, Mode

logger = logging.getLogger(__name__)
RATIO = 0.15
EXAMPLES = 60  # MuSiQue dev questions the contexts are drawn from


@dataclass(frozen=True)
class TierResult:
    tier: str
    prefetch_depth: int
    ttft_ms: float
    load_ms: float
    load_wait_ms: float
    load_hidden_ms: float
    recompute_ms: float
    context_tokens: int
    trials: int
    layer_load_ms: tuple[float, ...] = ()  # per layer (median over trials): the reader's time on it
    layer_wait_ms: tuple[float, ...] = ()  # ... how long compute blocked for it
    layer_compute_ms: tuple[float, ...] = ()  # ... the layer's compute
    waited_share: float = 0.0  # the share of layers where compute blocked more than WAITED_MS


WAITED_MS = 0.1  # a layer whose compute blocked longer than this for its load "waited"


def build_contexts(runner: ModelRunner, n: int = 2, target_tokens: int = 4000, data_dir: Path | None = None) -> list[Context]:
    """n contexts of ~target_tokens of real MuSiQue passages; context i starts at question i."""
    examples = load_examples("musique", EXAMPLES, data_dir)
    return [build_context(examples, target_tokens, lambda t: len(runner.encode(t)), start=i) for i in range(n)]


def precompute_all(runner: ModelRunner, contexts: list[Context]) -> dict[tuple[int, ...], ChunkKV]:
    """Token ids -> chunk KV (model precision) of every passage, computed once. Keyed by ids, not
    by store key: a store key includes the stored format, so each store keys the chunks itself."""
    eng = BlendEngine(runner, build_store(memory_bytes=0))
    chunks: dict[tuple[int, ...], ChunkKV] = {}
    for ctx in contexts:
        for p in ctx.passages:
            ids = tuple(eng.passage_tokens(p))
            if ids not in chunks:
                chunks[ids] = eng.precompute(list(ids))
    return chunks


def fill(store: KVStore, engine: BlendEngine, chunks: dict[tuple[int, ...], ChunkKV]) -> None:
    """Put every chunk under the key `engine` looks it up by (its model and stored format)."""
    for ids, kv in chunks.items():
        store.put(engine.key_of(list(ids)), kv)


def stored_after_answers(engine: BlendEngine, timeout_s: float = 120.0) -> None:
    """Wait until the engine stored what its answers missed (background work of its loop)."""
    deadline = time.monotonic() + timeout_s
    while engine.loop.stats()["store_queued"]:
        if time.monotonic() > deadline:
            raise RuntimeError("the engine did not store its missed passages in time")
        time.sleep(0.01)


def _no_misses(what: str, reports: list) -> None:
    if any(r.cache_misses or r.repaired_chunks for r in reports):
        raise RuntimeError(f"benchmark runs on {what} missed the cache; the store under test is not serving")


def _summarize(name: str, depth: int, runs: list) -> TierResult:
    _no_misses(name, [r.report for r in runs])
    med = statistics.median
    reps = [r.report for r in runs]
    return TierResult(
        tier=name, prefetch_depth=depth, ttft_ms=med([r.ttft_ms for r in runs]), load_ms=med([r.load_ms for r in reps]),
        load_wait_ms=med([r.load_wait_ms for r in reps]), load_hidden_ms=med([r.load_hidden_ms for r in reps]),
        recompute_ms=med([r.recompute_ms for r in reps]), context_tokens=reps[0].context_tokens, trials=len(runs),
        layer_load_ms=_per_layer(reps, "layer_load_ms", med), layer_wait_ms=_per_layer(reps, "layer_wait_ms", med),
        layer_compute_ms=_per_layer(reps, "layer_compute_ms", med),
        waited_share=statistics.mean(sum(w > WAITED_MS for w in r.layer_wait_ms) / max(1, len(r.layer_wait_ms))
                                     for r in reps),
    )


def _per_layer(rows: list, name: str, agg) -> tuple[float, ...]:
    """`agg` (median, mean) of each layer's value of field `name` over `rows` (reports or results)."""
    values = [getattr(r, name) for r in rows]
    return tuple(agg([v[i] for v in values]) for i in range(min(map(len, values)))) if values else ()


def measure_tiers(runner: ModelRunner, contexts: list[Context], chunks: dict[tuple[int, ...], ChunkKV], workdir: Path,
                  redis_url: str | None = None, trials: int = 3) -> list[TierResult]:
    """TTFT per tier (RAM, disk, disk without prefetch, Redis): median over trials, mean over contexts.

    Configurations are interleaved trial by trial, so load from other processes hits them alike.
    """
    fp = store_fingerprint(runner.fingerprint, "fp16")
    stores: dict[str, KVStore] = {"ram": build_store(memory_bytes=16 << 30, fingerprint=fp),
                                  "disk": build_store(memory_bytes=0, disk_dir=workdir / "kv", fingerprint=fp)}
    if redis_url:
        stores["redis"] = build_store(memory_bytes=0, redis_url=redis_url, redis_timeout_s=2.0, fingerprint=fp)
    configs = [("ram", 2), ("disk", 2), ("disk", 0)] + ([("redis", 2)] if redis_url else [])
    engines = {c: BlendEngine(runner, stores[c[0]], EngineConfig(kv_format="fp16", prefix_caching=False),
                             loader=build_loader(stores[c[0]], c[1]))
               for c in configs}
    for name, store in stores.items():
        fill(store, engines[name, 2], chunks)
    gen = GenerationConfig(max_tokens=1)
    per_ctx: dict[tuple[str, int], list[TierResult]] = {c: [] for c in configs}
    for ctx in contexts:
        plan = BlendPlan(passages=ctx.passages, question=ctx.question, recompute_ratio=RATIO)
        runs: dict[tuple[str, int], list] = {c: [] for c in configs}
        for c in configs:
            engines[c].run(plan, gen)  # warm-up: allocator, page cache, connections
            stored_after_answers(engines[c])  # the system prompt's chunk, stored after that answer
        for _ in range(trials):
            for c in configs:
                runs[c].append(engines[c].run(plan, gen))
        for c in configs:
            per_ctx[c].append(_summarize(c[0], c[1], runs[c]))
            logger.info("%s depth %d: %.0f ms", c[0], c[1], per_ctx[c][-1].ttft_ms)
    for store in stores.values():
        store.close()
    return [_merge(c[0], c[1], per_ctx[c]) for c in configs]


def _merge(name: str, depth: int, rs: list[TierResult]) -> TierResult:
    fields = {f: statistics.mean(getattr(r, f) for r in rs) for f in
              ("ttft_ms", "load_ms", "load_wait_ms", "load_hidden_ms", "recompute_ms")}
    layers = {f: _per_layer(rs, f, statistics.mean) for f in ("layer_load_ms", "layer_wait_ms", "layer_compute_ms")}
    return TierResult(tier=name, prefetch_depth=depth, context_tokens=round(statistics.mean(r.context_tokens for r in rs)),
                      trials=rs[0].trials * len(rs), waited_share=statistics.mean(r.waited_share for r in rs),
                      **fields, **layers)


def measure_formats(runner: ModelRunner, contexts: list[Context], chunks: dict[tuple[int, ...], ChunkKV]) -> dict:
    """Stored bytes per token (fp32, fp16, int8) and KL(fp16 || int8) of the first-token distribution,
    at blend@RATIO and at full_reuse (every cached value used as stored). Each store is filled under
    its own format's keys, and a run that missed the cache stops the benchmark (a miss is
    recomputed, which would measure recompute, not the format)."""
    one = next(iter(chunks.values()))
    out: dict = {"bytes_per_token": {}}
    for fmt in ("fp32", "fp16", "int8"):
        meta, _ = encode_chunk(fmt, one)
        out["bytes_per_token"][fmt] = meta.nbytes / one.n_tokens
    logits: dict[tuple[str, Mode], list[torch.Tensor]] = {}
    for fmt in ("fp16", "int8"):
        store = build_store(kv_format=fmt, memory_bytes=16 << 30)
        eng = BlendEngine(runner, store, EngineConfig(kv_format=fmt, prefix_caching=False), loader=build_loader(store))
        fill(store, eng, chunks)
        for c in contexts:  # stores the system prompt's chunk, as a served request does
            eng.run(BlendPlan(passages=c.passages, question=c.question, recompute_ratio=RATIO), GenerationConfig(max_tokens=1))
        stored_after_answers(eng)
        for mode, ratio in ((Mode.BLEND, RATIO), (Mode.FULL_REUSE, None)):
            results = [eng.prefill(BlendPlan(passages=c.passages, question=c.question, mode=mode, recompute_ratio=ratio))
                       for c in contexts]
            _no_misses(f"the {fmt} store", [r.report for r in results])
            logits[fmt, mode] = [r.logits for r in results]
    for mode, suffix in ((Mode.BLEND, ""), (Mode.FULL_REUSE, "_full_reuse")):
        pairs = list(zip(logits["fp16", mode], logits["int8", mode]))
        kls = [kl(a, b) for a, b in pairs]
        out[f"kl_int8_vs_fp16{suffix}"] = statistics.mean(kls)
        out[f"kl_per_context{suffix}"] = kls
        out[f"top1_agreement{suffix}"] = sum(int(a.argmax()) == int(b.argmax()) for a, b in pairs) / len(pairs)
    return out


@contextmanager
def local_redis() -> Iterator[str | None]:
    """A throwaway redis-server on a free 127.0.0.1 port, or None when the binary is absent."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.RedisError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def run(n_contexts: int = 1, target_tokens: int = 4000, trials: int = 3, redis_url: str | None = None,
        out_dir: Path = Path("results"), runner: ModelRunner | None = None) -> dict:
    runner = runner or ModelRunner.load()
    t0 = time.perf_counter()
    contexts = build_contexts(runner, n_contexts, target_tokens)
    chunks = precompute_all(runner, contexts)
    with tempfile.TemporaryDirectory() as tmp, (local_redis() if redis_url is None else _given(redis_url)) as url:
        tiers = measure_tiers(runner, contexts, chunks, Path(tmp), url, trials)
    formats = measure_formats(runner, contexts, chunks)
    ttft = {(r.tier, r.prefetch_depth): r.ttft_ms for r in tiers}
    result = {
        "model": runner.name, "device": str(runner.device), "ratio": RATIO, "contexts": n_contexts,
        "context_tokens": [c.n_tokens for c in contexts], "passages": [len(c.passages) for c in contexts],
        "tiers": [asdict(r) for r in tiers],
        "disk_over_ram": ttft[("disk", 2)] / ttft[("ram", 2)],
        "redis_over_ram": ttft[("redis", 2)] / ttft[("ram", 2)] if ("redis", 2) in ttft else None,
        "formats": formats,
        "note": "disk reads may come from the OS page cache (dropping it needs root)",
        "seconds": time.perf_counter() - t0,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_store.json").write_text(json.dumps(result, indent=2))
    return result


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url


def format_table(result: dict) -> str:
    lines = [f"{'tier':<6} {'depth':>5} {'TTFT ms':>9} {'load ms':>8} {'waited':>8} {'hidden':>8} {'compute':>8}"]
    for r in result["tiers"]:
        lines.append(f"{r['tier']:<6} {r['prefetch_depth']:>5} {r['ttft_ms']:>9.0f} {r['load_ms']:>8.1f} "
                     f"{r['load_wait_ms']:>8.1f} {r['load_hidden_ms']:>8.1f} {r['recompute_ms']:>8.0f}")
    lines += ["", "per layer (ms, median over trials): load / compute waited / compute, by tier and read-ahead depth",
              f"{'layer':>5} " + " ".join(f"{r['tier'] + ' d' + str(r['prefetch_depth']):>22}" for r in result["tiers"])]
    n_layers = min(len(r["layer_compute_ms"]) for r in result["tiers"])
    for i in range(n_layers):
        lines.append(f"{i:>5} " + " ".join(f"{r['layer_load_ms'][i]:>6.2f} / {r['layer_wait_ms'][i]:>5.2f} / "
                                           f"{r['layer_compute_ms'][i]:>5.1f}" for r in result["tiers"]))
    lines.append(f"layers where compute waited > {WAITED_MS:.1f} ms: "
                 + ", ".join(f"{r['tier']} d{r['prefetch_depth']} {r['waited_share']:.0%}" for r in result["tiers"]))
    f = result["formats"]
    lines.append(f"disk/RAM TTFT: {result['disk_over_ram']:.3f}x (target <= 1.15x)"
                 + (f", Redis/RAM: {result['redis_over_ram']:.3f}x" if result["redis_over_ram"] else ""))
    lines.append("bytes/token: " + ", ".join(f"{k} {v:.0f}" for k, v in f["bytes_per_token"].items())
                 + f"; KL(fp16||int8) first token: blend {f['kl_int8_vs_fp16']:.2e} (top-1 agreement "
                 f"{f['top1_agreement']:.0%}), full_reuse {f['kl_int8_vs_fp16_full_reuse']:.2e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--redis-url", default=None, help="default: start a local redis-server if installed")
    ap.add_argument("--out", type=Path, default=Path("results"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = run(args.contexts, args.tokens, args.trials, args.redis_url, args.out)
    print(format_table(result))  # noqa: T201
    print(f"wrote {args.out / 'bench_store.json'} in {result['seconds']:.0f} s")  # noqa: T201


if __name__ == "__main__":
    main()
