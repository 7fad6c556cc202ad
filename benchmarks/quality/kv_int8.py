"""What int8 KV storage costs: first-token KL(fp16 || int8) on the engine bench questions.

    python -m benchmarks.quality.kv_int8 --questions 20

Each MuSiQue dev question (the engine bench's, `benchmarks.ttft.engine`) with all its paragraphs as
cached passages, SmolLM2-135M; the same prefill (blend@0.15 with the default policy, and
full_reuse, where every cached value is used as stored) from an fp16 store and from an int8 store.
Also the first int8 layout (one scale per token and head for K too), re-created here, for the
before/after. Target (issue 14): mean KL <= 0.01 at blend@0.15.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import torch

from benchmarks.common.data import MUSIQUE_FILE, default_data_dir, passages_of, read_examples
from benchmarks.common.scoring import kl
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import ChunkKV, MemoryStore
from blend_engine.kv_store.codec import decode_chunk, encode_chunk
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan

logger = logging.getLogger(__name__)


def _per_token(x: torch.Tensor) -> torch.Tensor:
    """The first int8 layout's rounding: symmetric, one fp16 scale per token and head."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / 127).half().float().clamp_min(1e-8)  # [..., T, 1]
    return (torch.round(x.float() / scale).clamp(-127, 127) * scale).to(x.dtype)


class _OldInt8Store(MemoryStore):
    """An fp32 store holding values as the first int8 layout would have returned them."""

    def put(self, key: str, kv: ChunkKV) -> bool:
        return super().put(key, ChunkKV(_per_token(kv.k.float()), _per_token(kv.v.float())))


def run(n_questions: int, data: Path) -> dict:
    runner = ModelRunner.load()
    stores = {"fp16": MemoryStore(8 << 30, kv_format="fp16"), "int8": MemoryStore(8 << 30, kv_format="int8"),
              "int8 per-token K (old)": _OldInt8Store(8 << 30, kv_format="fp32")}
    engines = {name: BlendEngine(runner, s, EngineConfig(kv_format="fp16")) for name, s in stores.items()}
    rows = read_examples(data, n_questions)
    kls: dict[str, list[float]] = {}
    for i, row in enumerate(rows):
        passages = passages_of(row)
        ref_engine = engines["fp16"]
        for p in passages:
            ids = ref_engine.passage_tokens(p)
            kv = ref_engine.precompute(ids)
            for store in stores.values():
                store.put(ref_engine.key_of(ids), kv)
        for mode, ratio in (("blend", 0.15), ("full_reuse", None)):
            plan = BlendPlan(passages, row.question, mode=mode, recompute_ratio=ratio)
            ref = engines["fp16"].prefill(plan).logits
            for name in ("int8", "int8 per-token K (old)"):
                kls.setdefault(f"{name} {mode}", []).append(kl(ref, engines[name].prefill(plan).logits))
        logger.info("question %d/%d", i + 1, len(rows))
    one = next(iter(stores["fp16"].keys()))
    kv = decode_chunk(*stores["fp16"].get_blobs(one))
    sizes = {fmt: encode_chunk(fmt, kv)[0].nbytes / kv.n_tokens for fmt in ("fp16", "int8")}
    return {"questions": len(rows), "kl_mean": {k: statistics.fmean(v) for k, v in kls.items()},
            "kl_max": {k: max(v) for k, v in kls.items()}, "bytes_per_token": sizes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--data", type=Path, default=None, help="MuSiQue dev .jsonl (default: ../shared/data)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.threads)
    result = run(args.questions, args.data or default_data_dir() / MUSIQUE_FILE)
    print(json.dumps(result, indent=2))  # noqa: T201 - a CLI's report
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
