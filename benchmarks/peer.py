"""Optional peer: the same prompts through llama.cpp (llama-cpp-python) on the same GGUF, with its prompt cache.

Skipped with a message when `llama_cpp` is not importable (it is not a project dependency).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass

from benchmarks.data import Context, shuffled
from blend_engine.model import ModelRunner, default_gguf_path
from blend_engine.types import BlendPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerRow:
    case: str  # cold | same_prompt_cached | shuffled_after_cache
    target_tokens: int
    context_tokens: int
    ttft_ms: float


def available() -> tuple[bool, str]:
    if importlib.util.find_spec("llama_cpp") is None:
        return False, "llama-cpp-python is not installed (pip install llama-cpp-python); peer run skipped"
    return True, ""


def _ttft(llm, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    for _ in llm.create_completion(tokens, max_tokens=1, temperature=0.0, stream=True):
        break
    return (time.perf_counter() - t0) * 1e3


def run_peer(contexts: list[tuple[int, Context]], runner: ModelRunner, threads: int = 2) -> list[PeerRow]:
    """TTFT of llama.cpp per context: cold, the same prompt again (prompt cache), a shuffled order after it."""
    from llama_cpp import Llama, LlamaRAMCache

    llm = Llama(model_path=str(default_gguf_path()), n_ctx=8192, n_threads=threads, n_batch=512, verbose=False)
    llm.set_cache(LlamaRAMCache(capacity_bytes=4 << 30))
    rows: list[PeerRow] = []
    for target, ctx in contexts:
        original = _layout_tokens(runner, ctx.passages, ctx.question)
        reordered = _layout_tokens(runner, shuffled(ctx.passages, f"perf{target}"), ctx.question)
        llm.reset()
        llm.set_cache(LlamaRAMCache(capacity_bytes=4 << 30))
        for case, tokens in (("cold", original), ("same_prompt_cached", original), ("shuffled_after_cache", reordered)):
            rows.append(PeerRow(case, target, len(tokens), _ttft(llm, tokens)))
            logger.info("llama.cpp %s @%d tokens: ttft %.0f ms", case, target, rows[-1].ttft_ms)
    return rows


def _layout_tokens(runner: ModelRunner, passages: tuple[str, ...], question: str) -> list[int]:
    """Exactly the token ids our engine prefills (same tokenizer, same layout)."""
    from blend_engine.layout import DEFAULT_SYSTEM_PROMPT, build_layout

    plan = BlendPlan(passages, question)
    return build_layout(runner.encode, runner.tokenizer, DEFAULT_SYSTEM_PROMPT, plan.passages, plan.question).token_ids()
