"""Generation: sample from a prefill's logits, decode step by step, stream text deltas."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from blend_engine.sampling import Sampler, StreamDecoder
from blend_engine.types import BlendPlan, BlendResult, GenerationConfig

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine, PrefillState


class Generation:
    """Iterate to receive text deltas as they are decoded; `.result` once exhausted.

    The first delta marks time to first token. Per-request state lives here, never on the engine.
    """

    def __init__(self, engine: BlendEngine, plan: BlendPlan, gen: GenerationConfig) -> None:
        self._engine, self._plan, self._gen = engine, plan, gen
        self.result: BlendResult | None = None
        self.state: PrefillState | None = None
        self.ttft_ms: float | None = None

    def __iter__(self) -> Iterator[str]:
        eng, gen = self._engine, self._gen
        t0 = time.perf_counter()
        state = eng.prefill(self._plan, max_new_tokens=gen.max_tokens)
        self.state = state
        sampler = Sampler(gen.temperature, gen.top_p, gen.seed)
        decoder = StreamDecoder(eng.runner.tokenizer, gen.stop)
        stops = set(eng.runner.eos_token_ids)
        logits = state.logits
        tokens: list[int] = []
        finish = "length"
        for step in range(gen.max_tokens):
            tok = sampler(logits)
            if step == 0:
                self.ttft_ms = (time.perf_counter() - t0) * 1e3
            if tok in stops:
                finish = "stop"
                break
            tokens.append(tok)
            delta, hit_stop = decoder.push(tok)
            if delta:
                yield delta
            if hit_stop:
                finish = "stop"
                break
            if step + 1 < gen.max_tokens:
                logits = eng.decode_step(state.cache, tok)
        tail = decoder.flush()
        if tail:
            yield tail
        total_ms = (time.perf_counter() - t0) * 1e3
        eng.store_missing(state)
        store_ms = (time.perf_counter() - t0) * 1e3 - total_ms
        self.result = BlendResult(
            text=decoder.text,
            token_ids=tuple(tokens),
            finish_reason=finish,
            report=state.report,
            ttft_ms=self.ttft_ms if self.ttft_ms is not None else total_ms,
            total_ms=total_ms,
            store_ms=store_ms,
            explanation=state.explanation,
        )
