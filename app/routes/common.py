"""What the two query endpoints share: their request turned into a `QuerySpec`."""

from __future__ import annotations

from collections.abc import Sequence

from app.schemas import ChatCompletionRequest, QueryRequest
from app.service import QuerySpec, SuppliedDocument
from app.settings import ServiceSettings
from blend_engine.types import GenerationConfig, Mode
from retrieval.lexical import NO_FILTERS, Filters


def build_spec(settings: ServiceSettings, req: QueryRequest | ChatCompletionRequest, *, question: str, max_tokens: int,
               temperature: float, top_p: float = 1.0, stop: Sequence[str] = (), seed: int | None = None,
               system_prompt: str | None = None) -> QuerySpec:
    """The request's retrieval, mode and explain fields, with server defaults where it leaves them out."""
    documents = None if req.documents is None else tuple(SuppliedDocument(d.text, d.title) for d in req.documents)
    ratio = req.recompute_ratio if req.recompute_ratio is not None else settings.recompute_ratio
    return QuerySpec(
        question=question, top_k=req.top_k, documents=documents,
        mode=Mode.parse(req.mode or settings.default_mode), recompute_ratio=ratio,
        gen=GenerationConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=tuple(stop),
                             seed=seed),
        system_prompt=system_prompt, explain=req.explain, explain_max_tokens=settings.explain_max_tokens,
        retrieval=req.retrieval, filters=NO_FILTERS if req.filters is None else Filters(**req.filters.model_dump()),
    )
