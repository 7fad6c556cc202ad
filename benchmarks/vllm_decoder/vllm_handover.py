"""Blendserve's blended KV decoded by a stock vLLM server through `blendserve_vllm.connector` (issue
#55): greedy equality over many reordered prompts, and the hand-over's cost per prompt token against
a memcpy of the same bytes.

Per MuSiQue question (--paragraphs paragraphs, stored once, then reordered): Blendserve blends the
reordered prompt, decodes --tokens greedy tokens itself, and publishes the KV of all prompt tokens
but the last into a shared-memory segment (`executor.kv_export`, what the service does); vLLM is
asked the same token ids with the segment's handle and a fresh cache salt (nothing of the prompt in
its prefix cache), greedily. Printed per prompt and in sum: greedy tokens equal, the hand-over
(copy into the segment) in us per prompt token, a memcpy of the same bytes into a fresh buffer and
into a warm one, and vLLM's request time with the KV loaded.

    make bench-peer-vllm-install
    .venv/bin/python -m benchmarks.vllm_decoder.vllm_handover [--prompts 20] [--tokens 16] [--paragraphs 6]

Results: benchmarks/results/peer_vllm/vllm_handover.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import torch

from benchmarks.common.data import load_examples, shuffled
from benchmarks.common.service import free_port
from benchmarks.common.vllm_model import ensure_model_folder
from benchmarks.peers.peer_vllm_servers import REPO, SERVED_NAME, VllmSettings, pair_vllm_server
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.kv_export import export
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig, Mode
from blendserve_vllm.segments import SegmentPublisher
from retrieval.text import format_passage

logger = logging.getLogger(__name__)
OUT = REPO / "benchmarks" / "results" / "peer_vllm" / "vllm_handover.json"


@torch.inference_mode()
def blend_and_decode(engine: BlendEngine, plan: BlendPlan, n: int):
    """Blendserve's prefill of `plan` and its own greedy decode of `n` tokens from that KV."""
    t0 = time.perf_counter()
    state = engine.prefill(plan, max_new_tokens=n + 1)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    tokens, tok = [], int(torch.argmax(state.logits))
    for _ in range(n):
        tokens.append(tok)
        tok = int(torch.argmax(engine.decode_step(state.cache, tok)))
    return state, tokens, prefill_ms


def memcpy_us(nbytes: int, repeat: int = 3) -> tuple[float, float]:
    """Best of `repeat`: copying `nbytes` into a freshly allocated buffer (its pages faulted in, as a
    new segment's are) and into a warm one, in microseconds."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    warm = torch.empty_like(src)
    warm.copy_(src)
    fresh_t, warm_t = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.empty_like(src).copy_(src)
        fresh_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        warm.copy_(src)
        warm_t.append(time.perf_counter() - t0)
    return min(fresh_t) * 1e6, min(warm_t) * 1e6


def ask(url: str, ids: list[int], handle: str, n: int) -> tuple[list[int], int, float]:
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "cache_salt": uuid.uuid4().hex,
            "kv_transfer_params": {"blendserve_kv": handle}}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    tokens = [int(t.rsplit(":", 1)[1]) for t in out["choices"][0]["logprobs"]["tokens"]]
    return tokens, out["usage"]["prompt_tokens_details"]["cached_tokens"], seconds * 1e3


def one_prompt(engine: BlendEngine, publisher: SegmentPublisher, url: str, offset: int, args) -> dict:
    ex = load_examples("musique", 1, offset=offset)[0]
    passages = tuple(format_passage(p.text, p.title) for p in ex.paragraphs[: args.paragraphs])
    for _ in engine.generate(BlendPlan(passages, ex.question), GenerationConfig(max_tokens=1)):
        pass  # the passages' alone-KV stored, as ingestion leaves them
    plan = BlendPlan(shuffled(passages, f"handover-{offset}"), ex.question, mode=Mode.BLEND)
    state, own, prefill_ms = blend_and_decode(engine, plan, args.tokens)
    ids = state.layout.token_ids()
    with torch.inference_mode():
        exported = export(state.cache, ids[:-1], publisher)
    fresh_us, warm_us = memcpy_us(exported.nbytes)
    got, cached, vllm_ms = ask(url, ids, exported.handle, args.tokens)
    T = exported.n_tokens
    row = {"offset": offset, "prompt_tokens": len(ids), "handed_tokens": T, "bytes": exported.nbytes,
           "greedy_equal": got == own, "equal_tokens": sum(a == b for a, b in zip(got, own)),
           "vllm_cached_tokens": cached, "blend_prefill_ms": prefill_ms,
           "handover_us_per_token": exported.copy_ms * 1e3 / T, "memcpy_fresh_us_per_token": fresh_us / T,
           "memcpy_warm_us_per_token": warm_us / T, "vllm_request_ms": vllm_ms}
    logger.info("prompt %d: %d tokens, equal %d/%d, hand-over %.2f us/token (memcpy fresh %.2f, warm %.2f)",
                offset, len(ids), row["equal_tokens"], args.tokens, row["handover_us_per_token"],
                row["memcpy_fresh_us_per_token"], row["memcpy_warm_us_per_token"])
    return row


def summary(rows: list[dict]) -> dict:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {"prompts": len(rows), "greedy_equal": sum(r["greedy_equal"] for r in rows),
            "all_handed_over": all(r["vllm_cached_tokens"] == r["handed_tokens"] for r in rows),
            "handover_us_per_token_p50": med("handover_us_per_token"),
            "memcpy_fresh_us_per_token_p50": med("memcpy_fresh_us_per_token"),
            "memcpy_warm_us_per_token_p50": med("memcpy_warm_us_per_token"),
            "handover_over_memcpy_fresh": med("handover_us_per_token") / med("memcpy_fresh_us_per_token"),
            "handover_over_memcpy_warm": med("handover_us_per_token") / med("memcpy_warm_us_per_token"),
            "vllm_request_ms_p50": med("vllm_request_ms"), "prompt_tokens_p50": med("prompt_tokens")}


def run(args: argparse.Namespace) -> dict:
    model_dir = ensure_model_folder()
    runner = ModelRunner.load("default", device="cpu", dtype="float32")
    engine = BlendEngine(runner, MemoryStore(2 << 30, kv_format="fp32"), EngineConfig(kv_format="fp32"))
    settings = VllmSettings(cores=args.cores)
    with tempfile.TemporaryDirectory(prefix="blendserve-segments-", dir="/dev/shm") as segments:
        publisher = SegmentPublisher(segments)
        with pair_vllm_server(model_dir, settings, Path(segments), OUT.parent / "logs" / "vllm-handover.log",
                              free_port(), args.start_timeout) as url:
            rows = [one_prompt(engine, publisher, url, args.offset + i, args) for i in range(args.prompts)]
    engine.close()
    return {"settings": vars(args) | {"model_dir": str(model_dir)}, "summary": summary(rows), "prompts": rows}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_decoder.vllm_handover", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens compared per prompt")
    p.add_argument("--paragraphs", type=int, default=6)
    p.add_argument("--offset", type=int, default=100, help="the first MuSiQue question")
    p.add_argument("--cores", default="0-1", help="vLLM's VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--start-timeout", type=float, default=900)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run(args)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
