"""Token output: from a step's logits to each request's next token, its text and its result.

    logits [B, V] --read (one device->host read a step)--> top ids [B] (+ host rows where needed)
                  --take--> Sampler.pick -> eos? stop string? max_tokens? -> Delta(text, logprobs)
                  --result--> BlendResult (the stop decoder's tail flushed)

The loop's thread only; the request's sampler and stop decoder live on its `Request`.
"""

from __future__ import annotations

import time

import torch

from blend_engine.generation import Delta
from blend_engine.loop.requests import Request
from blend_engine.model.runner import ModelRunner
from blend_engine.sampling import HostLogits, Sampler, StreamDecoder, read_logits
from blend_engine.types import BlendResult, TokenLogprob

STOP, LENGTH = "stop", "length"  # finish reasons


class TokenOutput:
    """Sampling, stop decoding and logprobs for the requests of one engine loop."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @staticmethod
    def read(reqs: list[Request], logits: torch.Tensor) -> HostLogits:
        """The step's one device->host read of logits [B, V]: the full row only where a sampler
        draws from it or logprobs are asked for."""
        return read_logits(logits, [not r.sampler.greedy or r.handle.gen.logprobs is not None for r in reqs])

    def first(self, req: Request) -> str | None:
        """A fresh prefill's first token, from its state's logits [V]: the request's sampler and stop
        decoder are made here. Its finish reason when that token ended it (`take`)."""
        gen = req.handle.gen
        req.sampler = Sampler(gen.temperature, gen.top_p, gen.seed)
        req.decoder = StreamDecoder(self.runner.tokenizer, gen.stop)
        host = self.read([req], req.state.logits[None, :])  # [1, V]
        return self.take(req, host.top[0], host.rows.get(0))

    def take(self, req: Request, top: int, row: torch.Tensor | None) -> str | None:
        """Take the next token (`Sampler.pick` of the row's argmax `top` and its host logits [V])
        and stream it; its finish reason when the request stops here, else None."""
        gen = req.handle.gen
        tok = req.sampler.pick(top, row)
        if req.handle.ttft_ms is None:
            req.handle.ttft_ms = (time.perf_counter() - req.t0) * 1e3
        if tok in self.runner.eos_token_ids and not gen.ignore_eos:
            return STOP
        req.tokens.append(tok)
        lp = self._logprob(row, tok, gen.logprobs) if gen.logprobs is not None else ()
        req.logprobs.extend(lp)
        text, hit_stop = req.decoder.push(tok)
        if text or lp:
            req.handle.emit(Delta(text, lp))
        if hit_stop:
            return STOP
        if len(req.tokens) >= gen.max_tokens:
            return LENGTH
        req.next_token = tok
        return None

    def _logprob(self, logits: torch.Tensor, tok: int, k: int) -> tuple[TokenLogprob, ...]:
        """The sampled token's log probability and the k most likely alternatives, from host logits [V]."""
        logp = torch.log_softmax(logits.float(), dim=-1)  # [V]
        text = self.runner.decode
        top = torch.topk(logp, k) if k else None
        alts = tuple((text([int(i)]), float(v)) for v, i in zip(top.values, top.indices)) if top is not None else ()
        return (TokenLogprob(tok, text([tok]), float(logp[tok]), alts),)

    @staticmethod
    def result(req: Request, finish: str) -> BlendResult:
        """The answer, complete: the stop decoder's tail streamed, then its result."""
        tail = req.decoder.flush()
        if tail:
            req.handle.emit(Delta(tail))
        total_ms = (time.perf_counter() - req.t0) * 1e3
        state = req.state
        return BlendResult(
            text=req.decoder.text, token_ids=tuple(req.tokens), finish_reason=finish, report=state.report,
            ttft_ms=req.handle.ttft_ms if req.handle.ttft_ms is not None else total_ms, total_ms=total_ms,
            store_ms=0.0, explanation=state.explanation, logprobs=tuple(req.logprobs),
            queue_ms=req.group.queue_s * 1e3)
