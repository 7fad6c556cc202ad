"""The fixed cost of one blended request, counted on the CPU (issue #57 item 1): aten ops per layer
and the ops whose result the host reads inside the layer loop, for 3, 10 and 30 passages.

    python -m benchmarks.kernels.dispatch_count [--model tiny|default] [--passages 3,10,30] [--out f.json]

Each request runs through the engine's own paths, as the engine loop runs it: `BlendEngine.prepare`,
`start_run` into a run of a paged KV pool, its layer steps, `complete_run`; then one decode step
of its sequence over the pool (`executor.decode.decode_batch`, pooled: the loop's step). Counted by
`blend_engine.executor.dispatch_count.DispatchCount` (a TorchDispatchMode): per layer the ops of
its three phases, load (the next layer from the loader's stream: on the CPU it reads on the compute
thread, every chunk's blob gathered into one block by numpy, then a constant few ops; on a GPU on
its reader thread, uncounted) + place (the cached chunks written at their offsets, rotated) + pass
(projections, selection, attention, MLP); "outside" is everything before the first layer and
after the last (tables, uploads, logits, the final positions' one read).

Targets (held by tests/blend_engine/test_dispatch_count.py on a tiny random model): load + place +
pass ops per layer the same for any number of passages, and no host read inside the layer loop;
the same for full prefill and the decode step. The exception is `--selected-attention blocks`
(the CPU's SDPA fallback): its blocks read keys up to a data-dependent bound, one host read per
selection set, and more selected rows make more blocks (`executor.selection.Selection`).
`--model tiny` (the default: seconds) is an 8-layer random Llama with the default model's
tokenizer; `--model default` is SmolLM2-135M. Passages are MuSiQue dev paragraphs when the shared
data is there, else synthetic sentences.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.decode import decode_batch
from blend_engine.executor.dispatch_count import DispatchCount
from blend_engine.executor.kv_pool import KVPool
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.kv_blocks import Run, blocks_for
from blend_engine.types import BlendPlan

logger = logging.getLogger(__name__)

QUESTION = "Which river meets the hill of town 9?"
PHASES = ("load", "place", "pass")
# the tiny model: 8 layers so that a blend has layers before its check layer (0), the check layer
# (1), the schedule's narrowing layers (2-4) and plain layers after them (5-7, the last special)
TINY = dict(num_hidden_layers=8, max_position_embeddings=8192)


def synthetic_passages(n: int) -> tuple[str, ...]:
    """`n` distinct short passages (no data needed)."""
    return tuple(f"Passage {i} tells of town {i}, where river {i % 7} meets the hill of {3 * i}. "
                 f"The town has {i + 2} bridges and a market every {i % 5 + 1} days." for i in range(n))


def musique_passages(n: int) -> tuple[str, ...] | None:
    """The first `n` MuSiQue dev paragraphs (over as many questions as it takes); None without the data."""
    from benchmarks.common.data import load_examples

    try:
        examples = load_examples("musique", max(1, n // 10 + 1))
    except FileNotFoundError:
        return None
    paragraphs = [f"{p.title}\n{p.text}" for ex in examples for p in ex.paragraphs]
    return tuple(paragraphs[:n]) if len(paragraphs) >= n else None


@dataclass
class PassCount:
    """One pass over the layers, counted: per layer {phase: ops}, ops outside the loop, host reads."""

    layers: list[dict[str, int]]
    outside: int
    reads_inside: list[str]  # "layer/phase: what"
    reads_outside: list[str]

    @classmethod
    def of(cls, count: DispatchCount, n_layers: int) -> PassCount:
        per_layer = [{ph: count.ops(layer, ph) for ph in PHASES} for layer in range(n_layers)]
        inside = [f"{r.layer}/{r.phase}: {r.what}" for r in count.host_reads()]
        outside = [r.what for r in count.host_reads(inside=False) if r.layer is None]
        return cls(per_layer, count.ops(None), inside, outside)

    def total_ops(self, layer: int) -> int:
        """Load + place + pass ops at a layer: what must not grow with the passages."""
        return sum(self.layers[layer].values())


@dataclass
class RequestCount:
    """One request's counts: its prefill and one decode step after it."""

    mode: str
    passages: int
    tokens: int
    prefill: PassCount
    decode: PassCount


def engine_for(runner: ModelRunner, selected_attention: str = "auto") -> BlendEngine:
    """An engine over a float32 memory store (the CPU computes in float32: no cast on placement)."""
    return BlendEngine(runner, MemoryStore(1 << 30, kv_format="fp32"),
                       EngineConfig(kv_format="fp32", selected_attention=selected_attention, prefix_caching=False))


def cache_passages(eng: BlendEngine, plan: BlendPlan) -> None:
    """Every segment but the question cached alone (a blend then loads them all)."""
    for seg in eng.layout(plan).segments[:-1]:
        eng.cache_ids(seg.token_ids)


@torch.inference_mode()
def count_request(eng: BlendEngine, plan: BlendPlan, max_new_tokens: int = 4, block_tokens: int = 16) -> RequestCount:
    """Count one request as the engine loop runs it: its prefill into a run of a paged pool, then
    one pooled decode step of its sequence. Run once uncounted first (lazy set-up is not per request)."""
    for _ in range(2):  # the second run is counted
        prep = eng.prepare(plan, max_new_tokens)
        n = prep.layout.n_tokens
        pool = KVPool(eng.runner, blocks_for(n + max_new_tokens, block_tokens), block_tokens)
        cache = pool.view(Run(0, pool.n_blocks))
        with DispatchCount() as pc:
            run = eng.start_run(plan, prep, max_new_tokens, cache=cache)
            for _ in run.steps():
                pass
            state = eng.complete_run(plan, prep, run)
        token = int(state.logits.argmax())
        with DispatchCount() as dc:
            decode_batch(eng.runner, [state.cache], [token], [n])
    L = eng.runner.shape.n_layers
    return RequestCount(plan.mode.value, len(plan.passages), n,
                        PassCount.of(pc, L), PassCount.of(dc, L))


def count_all(eng: BlendEngine, passages: Sequence[str], sizes: Sequence[int], modes: Sequence[str] = ("blend", "full_prefill"),
              ratio: float = 0.15) -> list[RequestCount]:
    """Per mode and passage count: the request's counts."""
    out = []
    for n in sizes:
        for mode in modes:
            plan = BlendPlan(tuple(passages[:n]), QUESTION, mode=mode, recompute_ratio=ratio)
            cache_passages(eng, plan)
            out.append(count_request(eng, plan))
            logger.info("%s, %d passages: %d tokens", mode, n, out[-1].tokens)
    return out


def _cell(layer: dict[str, int]) -> str:
    return "+".join(str(layer[ph]) for ph in PHASES)


def table(counts: Sequence[RequestCount]) -> list[str]:
    """Markdown: a row per layer (load+place+pass ops), then ops outside the loop and host reads inside."""
    cols = [(c, "prefill", f"{c.mode} {c.passages}") for c in counts]
    cols += [(c, "decode", f"decode {c.passages}") for c in counts if c.mode == "blend"]
    lines = ["| layer | " + " | ".join(name for _, _, name in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    L = len(counts[0].prefill.layers)
    for layer in range(L):
        lines.append(f"| {layer} | " + " | ".join(_cell(getattr(c, part).layers[layer]) for c, part, _ in cols) + " |")
    lines.append("| outside | " + " | ".join(str(getattr(c, part).outside) for c, part, _ in cols) + " |")
    lines.append("| host reads in loop | " + " | ".join(str(len(getattr(c, part).reads_inside))
                                                        for c, part, _ in cols) + " |")
    lines.append("| prompt tokens | " + " | ".join(str(c.tokens) for c, _, _ in cols) + " |")
    return lines


def load_runner(model: str) -> ModelRunner:
    if model == "default":
        return ModelRunner.load()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from blend_engine.model.files import _gguf_cache_dir, default_gguf_path

    cached = _gguf_cache_dir(default_gguf_path())
    tokenizer = (AutoTokenizer.from_pretrained(cached) if (cached / "tokenizer.json").exists()
                 else ModelRunner.load().tokenizer)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, **TINY)
    return ModelRunner(LlamaForCausalLM(config).eval(), tokenizer, "tiny-dispatch")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "default"), default="tiny")
    ap.add_argument("--passages", default="3,10,30", help="passage counts, comma-separated")
    ap.add_argument("--selected-attention", default="auto", help="EngineConfig.selected_attention (auto, sdpa_mask, blocks)")
    ap.add_argument("--out", type=Path, help="write the counts as JSON here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sizes = [int(x) for x in args.passages.split(",")]
    passages = musique_passages(max(sizes))
    source = "MuSiQue dev paragraphs" if passages else "synthetic passages"
    passages = passages or synthetic_passages(max(sizes))
    runner = load_runner(args.model)
    eng = engine_for(runner, args.selected_attention)
    try:
        counts = count_all(eng, passages, sizes)
    finally:
        eng.close()
    print(f"model {runner.name} ({runner.shape.n_layers} layers), {source}, selected_attention="
          f"{args.selected_attention}; ops per layer as load+place+pass")
    print("\n".join(table(counts)))
    for c in counts:
        for part in ("prefill", "decode"):
            reads = getattr(c, part).reads_inside
            if reads:
                print(f"{c.mode} {c.passages} {part}: host reads in the loop: {', '.join(reads[:8])}")
    if args.out:
        args.out.write_text(json.dumps([asdict(c) for c in counts], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
