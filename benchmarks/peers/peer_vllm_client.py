"""One HTTP client for both systems of the vLLM peer comparison: the same prompt, greedy, streamed.

vLLM gets the token ids Blendserve would prefill (its chat template, system prompt and passage
layout, `numbered` as the service does) through `/v1/completions`; Blendserve gets the question and
the passages through `/v1/query`'s `documents`, served from its KV store. Each call returns a
`Reply`: client-side time to first token (request sent -> first streamed token), output tokens and,
when asked, the first token's top logprobs keyed by token text (both sides decoded alike:
`tokenizer.decode([id], skip_special_tokens=True)`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.peers.peer_vllm_report import merge_top
from blend_engine.layout import DEFAULT_SYSTEM_PROMPT, build_layout
from retrieval.text import format_passage

TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Reply:
    ttft_ms: float
    output_tokens: int
    text: str
    top: dict[str, float] = field(default_factory=dict)  # first token: text -> logprob (when asked)
    body: dict[str, Any] = field(default_factory=dict)  # Blendserve's final response (timings, stats, mode)
    total_ms: float | None = None  # sent until the stream's end, client side


class ReplyError(RuntimeError):
    """A request the server refused or failed."""


def prompt_ids(tokenizer: Any, passages: Sequence[str], question: str) -> list[int]:
    """The token ids Blendserve's service prefills for inline documents (`numbered`, default system prompt)."""
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    texts = tuple(format_passage(p) for p in passages)
    return build_layout(encode, tokenizer, DEFAULT_SYSTEM_PROMPT, texts, question, numbered=True).token_ids()


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str | None, str]]:
    """(event name or None, data) for each `data:` line of a server-sent event stream."""
    event = None
    async for line in lines:
        if line.startswith("event: "):
            event = line[7:].strip()
        elif line.startswith("data: "):
            yield event, line[6:]
            event = None


def vllm_body(ids: list[int], max_tokens: int, logprobs: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if logprobs:
        body.update({"logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True})
    return body


def blend_body(passages: Sequence[str], question: str, max_tokens: int, mode: str, logprobs: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"question": question, "documents": [{"text": p} for p in passages], "mode": mode,
                            "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if logprobs:
        body.update({"logprobs": True, "top_logprobs": TOP_LOGPROBS})
    return body


def token_text_of(decode: Callable[[list[int]], str]) -> Callable[[str], str]:
    """vLLM's `token_id:123` keys as the token's text, decoded as Blendserve decodes its alternatives."""
    def text(key: str) -> str:
        return decode([int(key.removeprefix("token_id:"))]) if key.startswith("token_id:") else key
    return text


async def vllm_call(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                    token_text: Callable[[str], str]) -> Reply:
    t0 = time.perf_counter()
    first: float | None = None
    text, tokens, top = [], 0, {}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise ReplyError(f"vLLM answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for _, data in sse_events(r.aiter_lines()):
            if data.strip() == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                first = first or time.perf_counter()
                text.append(choice.get("text") or "")
                lp = choice.get("logprobs") or {}
                if not top and lp.get("top_logprobs"):
                    top = merge_top((token_text(k), v) for k, v in lp["top_logprobs"][0].items())
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    if first is None:
        raise ReplyError("vLLM streamed no token")
    return Reply((first - t0) * 1e3, tokens, "".join(text), top, total_ms=(time.perf_counter() - t0) * 1e3)


async def blend_call(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Reply:
    t0 = time.perf_counter()
    first: float | None = None
    final: dict[str, Any] = {}
    async with http.stream("POST", f"{url}/v1/query", json=body) as r:
        if r.status_code != 200:
            raise ReplyError(f"Blendserve answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for event, data in sse_events(r.aiter_lines()):
            if event in ("delta", "done"):
                first = first or time.perf_counter()
            if event == "done":
                final = json.loads(data)
            elif event == "error":
                raise ReplyError(f"Blendserve streamed an error: {data[:300]}")
    if first is None or not final:
        raise ReplyError("Blendserve's stream ended without an answer")
    return Reply((first - t0) * 1e3, int(final["stats"]["completion_tokens"]), final["answer"],
                 _blend_top(final), final, (time.perf_counter() - t0) * 1e3)


def _blend_top(final: dict[str, Any]) -> dict[str, float]:
    content = ((final.get("logprobs") or {}).get("content")) or []
    if not content:
        return {}
    return merge_top((e["token"], e["logprob"]) for e in content[0].get("top_logprobs") or ())
