"""One engine step with a prefill's rows beside the decode rows (issue #35 item 4), against the
two run one after the other, on the default model (real weights; on a GPU when there is one).

    python -m benchmarks.kernels.fused_step [--batch 1,8,16] [--tokens 1024] [--passages 3] [--repeat 9]

The prefill is a blend@0.15 of a MuSiQue dev question over its first `--passages` paragraphs (their
KV cached first); the decode rows are B sequences of T tokens each in runs of one paged pool (random
K/V: timing does not depend on the values). Per B, medians of `--repeat` rounds (the four take turns in each):

- prefill alone, decode step alone;
- apart: the prefill's layers, then the decode step (what a step cost before item 4);
- fused: ONE pass over the layers, the decode rows and the prefill's rows through one projection
  and one MLP call a layer (`layers.layer_pass`, what the engine loop runs now).

Prints a table (and JSON to --out): the saving is apart - fused, and fused - prefill is what the
decode rows cost riding on the prefill's pass.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common.data import load_examples
from benchmarks.kernels.decode_attention import pool_runs, step_parser, sync, with_machine, write_json
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.decode import decode_batch, eager_rows, written
from blend_engine.executor.layers import layer_pass
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan

logger = logging.getLogger(__name__)


def _plan(passages: int) -> BlendPlan:
    ex = load_examples("musique", 1)[0]
    docs = tuple(f"{p.title}\n{p.text}" for p in ex.paragraphs[:passages])
    return BlendPlan(docs, ex.question, recompute_ratio=0.15)


class Step:
    """The three ways to run one step of a prefill and B decode rows."""

    def __init__(self, eng: BlendEngine, plan: BlendPlan, batch: int, n_tokens: int) -> None:
        self.eng, self.r, self.plan = eng, eng.runner, plan
        self.prep = eng.prepare(plan, 0)
        self.pool, self.runs = pool_runs(self.r, batch, n_tokens)
        self.tokens, self.pos = [7 + b for b in range(batch)], [n_tokens] * batch

    def _caches(self):
        return [self.pool.view(run, p) for run, p in zip(self.runs, self.pos)]

    def prefill(self) -> None:
        run = self.eng.start_run(self.plan, self.prep, 0)
        for layer in range(self.r.shape.n_layers):
            layer_pass(self.r, layer, [run.enter()])
            run.leave()
        self.eng.complete_run(self.plan, self.prep, run)

    def decode(self) -> torch.Tensor:
        return decode_batch(self.r, self._caches(), self.tokens, self.pos)  # [B, V]

    def apart(self) -> torch.Tensor:
        self.prefill()
        return self.decode()  # [B, V]

    def fused(self) -> torch.Tensor:
        caches = self._caches()
        run = self.eng.start_run(self.plan, self.prep, 0)
        rows = eager_rows(self.r, caches, self.tokens, self.pos)
        for layer in range(self.r.shape.n_layers):
            layer_pass(self.r, layer, [rows, run.enter()])  # | decode rows | prefill rows |
            run.leave()
        logits = rows.logits()  # [B, V]
        written(caches, self.pos)
        self.eng.complete_run(self.plan, self.prep, run)
        return logits


WAYS = ("prefill", "decode", "apart", "fused")


def medians_ms(r: ModelRunner, step: Step, repeat: int) -> dict[str, float]:
    """Each way's median time; the ways take turns within every repeat, so that a machine whose
    speed drifts (shared cores) slows them alike."""
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for i in range(repeat + 1):
        for way in WAYS:
            fn: Callable[[], object] = getattr(step, way)
            sync(r)
            t0 = time.perf_counter()
            fn()
            sync(r)
            if i:  # the first round is a warm-up
                times[way].append((time.perf_counter() - t0) * 1e3)
    return {w: round(statistics.median(t), 1) for w, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = step_parser(__doc__, repeat=9)
    ap.add_argument("--passages", type=int, default=3)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runner = ModelRunner.load()
    eng = BlendEngine(runner, MemoryStore(1 << 30), EngineConfig())
    plan = _plan(args.passages)
    for seg in eng.layout(plan).segments[:-1]:
        eng.cache_ids(seg.token_ids)
    rows = []
    try:
        with torch.inference_mode():
            for b in (int(x) for x in args.batch.split(",")):
                step = Step(eng, plan, b, args.tokens)
                ms = medians_ms(runner, step, args.repeat)
                rows.append({"batch": b, "tokens": args.tokens, "prompt_tokens": step.prep.layout.n_tokens, **ms,
                             "saved_ms": round(ms["apart"] - ms["fused"], 1),
                             "decode_riding_ms": round(ms["fused"] - ms["prefill"], 1)})
                logger.info("B=%d: %s", b, rows[-1])
    finally:
        eng.close()
    print("| B | prompt tokens | prefill | decode step | apart | fused | saved | decode rows riding |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} | {row['prompt_tokens']} | {row['prefill']} | {row['decode']} | {row['apart']} | "
              f"{row['fused']} | {row['saved_ms']} | {row['decode_riding_ms']} |")
    write_json(args.out, with_machine(runner, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
