"""`python -m benchmarks.ingestion.ingest` (`make bench-ingest`): ingestion rate, KV bytes per token, index search latency.

Ingestion runs the configured model (BLENDSERVE_MODEL_NAME, default SmolLM2-135M) over the first
--passages records of the sample corpus into a temporary data directory. Index latency uses
synthetic unit vectors (384-d, the embedder's width) at 10K and 100K vectors, one query at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from blendserve_config.settings import SAMPLE_CORPUS, Settings
from corpus_tools.documents import Reader
from retrieval.index import IndexParams, VectorIndex


def bench_ingest(n_passages: int, corpus: Path, tmp: Path) -> dict:
    from blendserve_config.stack import build_stack  # loads the model stack only when ingestion is measured

    lines = corpus.read_text().splitlines(keepends=True)[:n_passages]
    subset = tmp / "corpus.jsonl"
    subset.write_text("".join(lines))
    settings = Settings(data_dir=tmp / "data", ingest={"sample_on_start": False})
    t0 = time.perf_counter()
    stack = build_stack(settings)
    startup = time.perf_counter() - t0
    try:
        stack.pipeline.ensure_system_prefix()
        before = stack.store.stats().bytes_used
        s = stack.pipeline.ingest(Reader().read([subset]), progress=True)
        stored = stack.store.stats().bytes_used - before
        tier_bytes = {t["name"]: t["bytes_used"] for t in stack.store.stats().extra.get("tiers", [])}
        return {
            "model": stack.runner.name, "device": str(stack.runner.device), "kv_format": stack.engine.config.kv_format,
            "startup_s": startup, "passages": s.passages, "tokens": s.tokens, "seconds": s.seconds,
            "passages_per_s": s.passages / s.seconds, "tokens_per_s": s.tokens / s.seconds,
            "kv_share": s.kv_seconds / s.seconds, "embed_share": s.embed_seconds / s.seconds,
            "index_store_share": s.index_seconds / s.seconds,
            "kv_bytes_per_token_model": stack.pipeline.kv_bytes_per_token(),
            "kv_bytes_per_token_stored": (tier_bytes.get("disk", stored) / s.tokens) if s.tokens else 0.0,
            "kv_bytes": s.kv_bytes,
        }
    finally:
        stack.close()


def bench_index(n: int, kind: str, dim: int = 384, queries: int = 300, k: int = 5) -> dict:
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((n, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    index = VectorIndex(dim, IndexParams(kind=kind, ivf_min_train=min(n, 20_000)))
    t0 = time.perf_counter()
    for start in range(0, n, 10_000):
        index.add(np.arange(start, min(n, start + 10_000), dtype=np.int64), vecs[start:start + 10_000])
    build = time.perf_counter() - t0
    qs = vecs[rng.integers(0, n, queries)] + 0.05 * rng.standard_normal((queries, dim)).astype(np.float32)
    lat, recall = [], 0
    exact = (qs @ vecs.T).argmax(axis=1)  # [Q]
    for i, q in enumerate(qs):
        t = time.perf_counter()
        _, ids = index.search(q[None], k)
        lat.append(time.perf_counter() - t)
        recall += int(exact[i] in ids[0])
    ms = np.asarray(lat) * 1e3
    return {"vectors": n, "kind": index.kind, "build_s": build, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "recall_at_k": recall / queries}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ingestion.ingest", description=__doc__)
    p.add_argument("--passages", type=int, default=40, help="sample corpus records to ingest (0 = skip)")
    p.add_argument("--sizes", default="10000,100000", help="index sizes")
    p.add_argument("--kinds", default="flat,hnsw,ivf", help="index kinds")
    p.add_argument("--threads", type=int, default=0, help="torch/faiss threads (0 = library default)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        import faiss
        import torch

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    results: dict = {"index": []}
    if args.passages:
        with tempfile.TemporaryDirectory() as tmp:
            results["ingest"] = bench_ingest(args.passages, SAMPLE_CORPUS, Path(tmp))
    for n in (int(x) for x in args.sizes.split(",") if x):
        for kind in args.kinds.split(","):
            results["index"].append(bench_index(n, kind))
    if args.json:
        print(json.dumps(results))
        return 0
    ing = results.get("ingest")
    if ing:
        print(f"ingestion ({ing['model']} on {ing['device']}, {ing['kv_format']}): {ing['passages']} passages, "
            f"{ing['tokens']} tokens in {ing['seconds']:.1f} s")
        print(f"  rate            {ing['passages_per_s']:.2f} passages/s, {ing['tokens_per_s']:.0f} tokens/s")
        print(f"  time share      KV precompute {100 * ing['kv_share']:.0f}%, embedding {100 * ing['embed_share']:.0f}%, "
            f"index+SQLite {100 * ing['index_store_share']:.0f}%")
        print(f"  KV bytes/token  {ing['kv_bytes_per_token_model']} (stored, from the codec); "
            f"stored on disk {ing['kv_bytes_per_token_stored']:.0f} incl. headers "
            f"({ing['kv_bytes'] / 2**20:.1f} MiB for the run)")
    print("index search (1 query, k=5, 384-d synthetic):")
    for r in results["index"]:
        print(f"  {r['vectors']:>7} {r['kind']:<5} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
            f"recall@5 {r['recall_at_k']:.2f}  build {r['build_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
