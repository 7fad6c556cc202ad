"""What the query endpoints share: their request turned into a `QuerySpec`, and OpenAI's pieces
(sampling fields, SSE chunk heads) that chat and completions both use."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from app.auth import cache_namespace
from app.schemas import ChatCompletionRequest, CompletionRequest, QueryRequest
from app.service import QuerySpec, SuppliedDocument
from app.settings import ServiceSettings
from app.validation import field_error
from blend_engine.types import GenerationConfig, Mode, Turn
from retrieval.lexical import NO_FILTERS, Filters


def build_spec(settings: ServiceSettings, req: QueryRequest | ChatCompletionRequest | CompletionRequest, *,
               question: str, max_tokens: int, temperature: float, top_p: float = 1.0, stop: Sequence[str] = (),
               seed: int | None = None, system_prompt: str | None = None, turns: tuple[Turn, ...] = (),
               search: str | None = None, n: int = 1, logprobs: int | None = None,
               tenant: str | None = None, ignore_eos: bool = False) -> QuerySpec:
    """The request's retrieval, mode and explain fields, with server defaults where it leaves them out."""
    documents = None if req.documents is None else tuple(SuppliedDocument(d.text, d.title) for d in req.documents)
    ratio = req.recompute_ratio if req.recompute_ratio is not None else settings.engine.recompute_ratio
    return QuerySpec(
        question=question, top_k=req.top_k, documents=documents,
        mode=Mode.parse(req.mode or settings.engine.default_mode), recompute_ratio=ratio,
        gen=GenerationConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=tuple(stop),
                             seed=seed, ignore_eos=ignore_eos, logprobs=logprobs),
        system_prompt=system_prompt, explain=req.explain, explain_max_tokens=settings.limits.explain_max_tokens,
        retrieval=req.retrieval, filters=NO_FILTERS if req.filters is None else Filters(**req.filters.model_dump()),
        turns=turns, search=search, n=n, cache_salt=cache_namespace(tenant, req.cache_salt),
        source_chars=settings.limits.source_text_chars,
    )


def openai_spec(settings: ServiceSettings, req: ChatCompletionRequest | CompletionRequest, *, question: str,
                max_tokens: int | None, logprobs: int | None, **conversation) -> QuerySpec:
    """A chat or completions request's spec: OpenAI's sampling fields, with this server's defaults
    (temperature 0, top_p 1, at most 256 new tokens unless asked)."""
    max_tokens = max_tokens or min(256, settings.limits.max_new_tokens)
    if max_tokens > settings.limits.max_new_tokens:
        raise field_error(("max_tokens",), f"max_tokens must be at most {settings.limits.max_new_tokens}", max_tokens)
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return build_spec(settings, req, question=question, max_tokens=max_tokens, temperature=req.temperature or 0.0,
                      top_p=req.top_p or 1.0, stop=stop, seed=req.seed, n=req.n or 1, logprobs=logprobs,
                      **conversation)


@dataclass(frozen=True)
class Head:
    """The fields every OpenAI object of one response repeats."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> Head:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def fields(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
