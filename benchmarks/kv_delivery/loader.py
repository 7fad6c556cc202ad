"""Loader benchmark: how fast the KV tiers deliver a layer stream into the staging buffers, against
the physical limit of this machine.

8B-shaped chunks (32 layers, 8 KV heads, head dim 128, 256 tokens: 1 MiB a layer in fp16), 16 of
them (a 4K-token context), fp16 and int8. Per format:

- disk, warm: the disk tier's layer stream (`LayerLoader`, read-ahead 2, `READERS` reads in
  flight, each chunk's layer read straight into its staging region and verified) against a raw
  sequential read of the same files into one preallocated buffer, both from the page cache;
- disk, cold: the same with the files' pages dropped before every run (`posix_fadvise
  DONTNEED` on them; with `--drop-caches`, as root, the whole page cache too);
- disk, O_DIRECT: the tier with `direct_io` against a raw O_DIRECT read of the same files;
- memory: the memory tier's stream with every blob copied into its staging region by the
  stream's thread, one pass per layer (the host side of a device upload from pageable memory; a
  CUDA host's pinned tier needs no host copy at all) against one thread's plain memcpy of as many
  bytes, a layer at a time into one layer-sized buffer (which stays in a 32 MiB L3 cache for an
  8-16 MiB layer);
- memory_ring: the same stream against a memcpy into as many layer-sized buffers, round robin, as
  the staging ring has slots (read-ahead + 2): the destination footprint any staged delivery with
  read-ahead writes, which no longer fits in the cache.

    python -m benchmarks.kv_delivery.loader [--chunks 16] [--reps 5] [--formats fp16,int8] [--dir DIR] [--drop-caches]
        (make bench-loader)

Reference and tier are measured alternately, `reps` pairs; the ratio is the median of the
per-pair ratios (the machine's load drifts between runs; it is printed too).

Results: benchmarks/results/loader/results.json and a table on stdout (docs/results.md, "KV delivery").
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from blend_engine.kv_store import ChunkKV
from blend_engine.kv_store.blob import BlobStore
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.loader import READERS, LayerLoader
from blend_engine.kv_store.memory import MemoryStore
from blend_engine.kv_store.staging import StagedLayer, StagingRing

SHAPE = {"n_layers": 32, "n_heads": 8, "head_dim": 128, "n_tokens": 256}  # Llama-3-8B's KV, 256-token chunks
OUT = Path("benchmarks/results/loader")
DEPTH = 2  # the service's read-ahead (factory.build_loader)


class StageSink:
    """The loader's consumer: takes each staged layer (bringing tier buffers into the slot when
    `gather`) and counts the bytes; the ring is what the engine's packer reads into."""

    def __init__(self, gather: bool) -> None:
        self.staging = StagingRing(DEPTH + 2, pinned=False, gather=gather)
        self.gather = gather
        self.nbytes = 0

    def __call__(self, staged: StagedLayer) -> None:
        if self.gather:
            staged.gather()
        self.nbytes += staged.nbytes


def make_chunks(n: int, seed: int = 0) -> list[ChunkKV]:
    g = torch.Generator().manual_seed(seed)
    L, H, T, D = SHAPE["n_layers"], SHAPE["n_heads"], SHAPE["n_tokens"], SHAPE["head_dim"]
    return [ChunkKV(torch.randn((L, H, T, D), generator=g, dtype=torch.float32).half(),  # [L, H, T, D]
                    torch.randn((L, H, T, D), generator=g, dtype=torch.float32).half())
            for _ in range(n)]


def stream_rate(store: BlobStore, keys: list[str], gather: bool) -> float:
    """GB/s of one layer stream over every chunk into the staging ring."""
    sink = StageSink(gather)
    t0 = time.perf_counter()
    stream = LayerLoader(store, DEPTH).stream(keys, SHAPE["n_layers"], repair=_no_repair, pack=sink)
    try:
        for _ in stream:
            pass
    finally:
        stream.close()
    return sink.nbytes / (time.perf_counter() - t0) / 1e9


def _no_repair(key: str) -> ChunkKV:
    raise AssertionError(f"chunk {key} needed a repair in the benchmark")


def raw_rate(files: list[Path], direct: bool = False) -> float:
    """GB/s of a sequential read of each whole file into one preallocated (page-aligned) buffer."""
    size = max(f.stat().st_size for f in files)
    buf = mmap.mmap(-1, -(-size // 4096) * 4096)  # page-aligned, as O_DIRECT wants
    total, t0 = 0, time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            n = f.stat().st_size
            total += os.preadv(fd, [memoryview(buf)[:-(-n // 4096) * 4096 if direct else n]], 0)
        finally:
            os.close(fd)
    rate = total / (time.perf_counter() - t0) / 1e9
    buf.close()
    return rate


def memcpy_rate(src: np.ndarray, layer_bytes: int, slots: int = 1) -> float:
    """GB/s of one thread's plain copies of `src` (as many bytes as the tier holds, so not cache
    resident), a layer's worth at a time, into `slots` layer-sized buffers round robin (touched
    before: no page faults). One slot is the plain reference (its buffer stays in the L3 cache);
    `DEPTH + 2` slots write the footprint a staging ring with read-ahead writes."""
    dsts = [np.ones(layer_bytes, dtype=np.uint8) for _ in range(slots)]
    t0 = time.perf_counter()
    for i, o in enumerate(range(0, src.size - layer_bytes + 1, layer_bytes)):
        np.copyto(dsts[i % slots], src[o:o + layer_bytes])
    return src.size / (time.perf_counter() - t0) / 1e9


def drop_cache(files: list[Path], system: bool = False) -> str:
    """Evict the files' pages with posix_fadvise(DONTNEED) (their pages are clean: written and
    synced), and with `system` the whole page cache too (drop_caches, root only). What was used."""
    how = "fadvise"
    os.sync()
    if system:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            how = "drop_caches+fadvise"
        except OSError:
            pass
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return how


def paired(raw: Callable[[], float], tier: Callable[[], float], reps: int,
           before: Callable[[], object] | None = None) -> dict:
    """Reference and tier measured alternately `reps` times (a shared machine's load drifts): the
    median of each rate and of the per-pair ratios tier / reference."""
    pairs = []
    for _ in range(reps):
        pair = []
        for fn in (raw, tier):
            if before is not None:
                before()
            pair.append(fn())
        pairs.append(pair)
    return {"raw": statistics.median(r for r, _ in pairs), "tier": statistics.median(t for _, t in pairs),
            "ratio": statistics.median(t / r for r, t in pairs), "pairs": pairs}


def measure_format(fmt: str, chunks: list[ChunkKV], root: Path, reps: int, system_drop: bool = False) -> dict:
    disk = DiskStore(root / fmt, 1 << 40, kv_format=fmt)
    keys = [f"{fmt}{i:04d}" for i in range(len(chunks))]
    for key, kv in zip(keys, chunks):
        disk.put(key, kv)
    files = [disk.path(k) for k in keys]
    direct = DiskStore(root / fmt, 1 << 40, kv_format=fmt, direct_io=True)
    memory = MemoryStore(1 << 40, kv_format=fmt, pinned=False)
    for key in keys:
        memory.put_blobs(key, *disk.get_blobs(key))
    meta = disk.meta(keys[0])
    out = {"format": fmt, "chunks": len(chunks), "bytes": meta.nbytes * len(chunks),
           "layer_bytes_per_chunk": meta.layer_nbytes}
    raw_rate(files), stream_rate(disk, keys, gather=False)  # warm the page cache and the readers
    out["disk_warm"] = paired(lambda: raw_rate(files), lambda: stream_rate(disk, keys, gather=False), reps)
    out["disk_cold"] = paired(lambda: raw_rate(files), lambda: stream_rate(disk, keys, gather=False), reps,
                              lambda: drop_cache(files, system_drop))
    out["disk_cold"]["dropped_with"] = drop_cache(files, system_drop)
    try:
        out["disk_direct"] = paired(lambda: raw_rate(files, direct=True),
                                    lambda: stream_rate(direct, keys, gather=False), reps)
    except OSError as exc:  # a file system without O_DIRECT
        out["disk_direct"] = {"error": str(exc)}
    src = np.random.default_rng(0).integers(0, 255, meta.nbytes * len(keys), dtype=np.uint8)
    stream_rate(memory, keys, gather=True)
    out["memory"] = paired(lambda: memcpy_rate(src, meta.layer_nbytes * len(keys)),
                           lambda: stream_rate(memory, keys, gather=True), reps)
    out["memory_ring"] = paired(lambda: memcpy_rate(src, meta.layer_nbytes * len(keys), DEPTH + 2),
                                lambda: stream_rate(memory, keys, gather=True), reps)
    return out


def format_table(results: list[dict]) -> str:
    lines = ["| format | path | tier GB/s | reference GB/s | ratio | reference |", "|---|---|---|---|---|---|"]
    refs = {"disk_warm": "raw read, page cache warm", "disk_cold": "raw read, page cache dropped",
            "disk_direct": "raw O_DIRECT read", "memory": "memcpy into one layer buffer",
            "memory_ring": f"memcpy into {DEPTH + 2} layer buffers (the staging ring's footprint)"}
    for r in results:
        for row, ref in refs.items():
            x = r[row]
            if "tier" not in x:
                lines.append(f"| {r['format']} | {row} | - | - | - | {x.get('error', '')} |")
                continue
            lines.append(f"| {r['format']} | {row} | {x['tier']:.2f} | {x['raw']:.2f} | {x['ratio']:.2f}x | {ref} |")
    return "\n".join(lines)


def run(n_chunks: int = 16, reps: int = 5, formats: tuple[str, ...] = ("fp16", "int8"), workdir: Path | None = None,
        system_drop: bool = False) -> dict:
    load_before = os.getloadavg()
    chunks = make_chunks(n_chunks)
    root = Path(tempfile.mkdtemp(prefix="bench-loader-", dir=workdir))
    try:
        results = [measure_format(fmt, chunks, root, reps, system_drop) for fmt in formats]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"shape": SHAPE, "readers": READERS, "read_ahead": DEPTH, "reps": reps, "cpus": os.cpu_count(),
            "load_before": load_before, "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--formats", default="fp16,int8")
    ap.add_argument("--dir", type=Path, default=None, help="where the chunk files go (default: the temp dir)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--drop-caches", action="store_true", help="cold runs also drop the whole page cache (root)")
    args = ap.parse_args(argv)
    result = run(args.chunks, args.reps, tuple(args.formats.split(",")), args.dir, args.drop_caches)
    result["load_after"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(format_table(result["results"]))  # noqa: T201 - the benchmark's report
    print(f"load average before {result['load_before']}, after {result['load_after']}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
