"""HTTP bodies from the request logic's results: the one place that builds the query response models.

`app.service.QueryRun` ends with domain data (`QueryOutcome`: the answer, `PassageRef`s, the
engine's report and `Explanation`). `present` turns it into the `/v1/query` body once, on the
event loop (explain's token pieces are a tokenizer decode of at most `explain_max_tokens` ids);
`/v1/chat/completions` reuses that body for its `passages` and `blend` fields.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.schemas import (
    ChatChoice,
    ChatChoiceMessage,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Explain,
    LogprobEntry,
    PassageExplain,
    PassageOut,
    PromptTokensDetails,
    QueryExplainedResponse,
    QueryResponse,
    QueryStats,
    QuestionExplain,
    SourceOut,
    SystemExplain,
    Timings,
    TopLogprob,
    Usage,
)
from app.service import PassageRef, QueryOutcome
from blend_engine.explain import Explanation, SegmentExplanation, token_pieces
from blend_engine.types import TokenLogprob


@dataclass(frozen=True)
class Answered:
    """A finished query (for metrics and logs) and its `/v1/query` body (for either endpoint)."""

    outcome: QueryOutcome
    body: QueryResponse


def present(outcome: QueryOutcome, tokenizer: Any, explain_max_tokens: int, logprobs: bool = False) -> Answered:
    """The outcome with its HTTP body (the tokenizer decodes explain's tokens)."""
    explain = (explain_response(tokenizer, outcome.explanation, outcome.passages, explain_max_tokens)
               if outcome.explanation is not None else None)
    return Answered(outcome, query_response(outcome, explain, logprobs))


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> ChoiceLogprobs:
    """OpenAI's chat format: per token its text, logprob, UTF-8 bytes and the most likely alternatives."""
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return ChoiceLogprobs(content=[LogprobEntry(**entry(t.text, t.logprob),
                                                top_logprobs=[TopLogprob(**entry(x, lp)) for x, lp in t.top])
                                   for t in tokens])


def completion_logprobs(tokens: Sequence[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
    """The legacy completions format; `text_offset` counts characters from `offset`."""
    offsets = list(itertools.accumulate((len(t.text) for t in tokens), initial=offset))[:-1]
    return CompletionLogprobs(tokens=[t.text for t in tokens], token_logprobs=[t.logprob for t in tokens],
                              top_logprobs=[dict(t.top) for t in tokens], text_offset=offsets)


def passages_out(refs: Sequence[PassageRef]) -> list[PassageOut]:
    return [PassageOut(id=p.id, title=p.title, score=p.score, doc_id=p.doc_id, location=p.location) for p in refs]


def sources_out(refs: Sequence[PassageRef]) -> list[SourceOut]:
    """The passages as citable sources: number n is the `[n]` before the passage in the prompt."""
    return [SourceOut(index=n, id=p.id, doc_id=p.doc_id, title=p.title, passage=p.seq, location=p.location or None,
                      score=p.score, text=p.text, truncated=p.truncated)
            for n, p in enumerate(refs, 1)]


def query_response(outcome: QueryOutcome, explain: Explain | None = None, logprobs: bool = False) -> QueryResponse:
    """The `/v1/query` body (`QueryExplainedResponse` when the request asked for explain)."""
    r = outcome.report
    extra = {"explain": explain} if explain is not None else {}
    return (QueryExplainedResponse if extra else QueryResponse)(
        **extra,
        answer=outcome.answer,
        passages=passages_out(outcome.passages),
        sources=sources_out(outcome.passages),
        logprobs=chat_logprobs(outcome.choices[0].logprobs) if logprobs and outcome.choices else None,
        mode=r.mode,
        finish_reason=outcome.finish_reason,
        timings=Timings(
            retrieval_ms=round(outcome.retrieval_ms, 3),
            kv_load_ms=round(r.load_ms, 3),
            recompute_ms=round(r.recompute_ms, 3),
            ttft_ms=round(outcome.ttft_ms, 3),
            total_ms=round(outcome.total_ms, 3),
            queue_ms=round(outcome.queue_ms, 3),
            plan_ms=round(outcome.plan_ms, 3),
            prefill_ms=round(outcome.prefill_ms, 3),
            decode_ms=round(outcome.decode_ms, 3),
            kv_store_ms=round(outcome.store_ms, 3),
            **decoder_timings(outcome.decoder),
        ),
        stats=QueryStats(
            context_tokens=r.context_tokens,
            recomputed_tokens=r.recomputed_tokens,
            recompute_ratio=r.recompute_ratio,
            cache_hits=r.cache_hits,
            cache_misses=r.cache_misses,
            prefix_tokens_reused=r.prefix_tokens_reused,
            ratio_source=r.ratio_source,
            completion_tokens=outcome.completion_tokens,
            fallback=outcome.fallback,
            decoder="own" if outcome.decoder is None else "vllm",
            decoder_cached_tokens=None if outcome.decoder is None else outcome.decoder["cached_tokens"],
        ),
    )


def decoder_timings(split: dict | None) -> dict[str, float]:
    """The vLLM decoder's timings fields (none with the own engine)."""
    if split is None:
        return {}
    names = ("blend_ms", "handover_ms", "decoder_ttft_ms", "decoder_ms")
    return {n: round(split[n], 3) for n in names}


def explain_response(tokenizer: Any, ex: Explanation, passages: Sequence[PassageRef], max_tokens: int) -> Explain:
    """The engine's explanation as the API shows it: token text pieces, at most `max_tokens` listed
    (passages then the question, in prompt order); counts always cover every token."""
    sys_seg, *middle, q_seg = ex.segments
    budget = max_tokens
    summaries = {kind: [SystemExplain(n_tokens=len(s.token_ids), recomputed_tokens=s.recomputed_tokens, cache=s.cache,
                                      tier=s.tier) for s in middle if s.kind == kind] for kind in ("marker", "turn")}

    def take(seg: SegmentExplanation) -> int:
        nonlocal budget
        n = min(len(seg.token_ids), budget)
        budget -= n
        return n

    out = []
    for i, (seg, meta) in enumerate(zip([s for s in middle if s.kind == "passage"], passages)):
        n = take(seg)
        out.append(PassageExplain(
            index=i, id=meta.id, title=meta.title, n_tokens=len(seg.token_ids),
            recomputed_tokens=seg.recomputed_tokens, cache=seg.cache, tier=seg.tier,
            tokens=token_pieces(tokenizer, seg.token_ids[:n]), recomputed=list(seg.recomputed[:n]),
            scores=[None if s is None else float(f"{s:.5g}") for s in seg.scores[:n]],
            truncated=n < len(seg.token_ids),
        ))
    nq = take(q_seg)
    question = QuestionExplain(n_tokens=len(q_seg.token_ids), recomputed_tokens=q_seg.recomputed_tokens,
                               tokens=token_pieces(tokenizer, q_seg.token_ids[:nq]),
                               recomputed=list(q_seg.recomputed[:nq]), truncated=nq < len(q_seg.token_ids))
    return Explain(
        check_layer=ex.check_layer, metric=ex.metric, max_tokens=max_tokens, explained_tokens=max_tokens - budget,
        truncated=any(p.truncated for p in out) or question.truncated,
        passage_recomputed_tokens=sum(p.recomputed_tokens for p in out),
        system=SystemExplain(n_tokens=len(sys_seg.token_ids), recomputed_tokens=sys_seg.recomputed_tokens,
                             cache=sys_seg.cache, tier=sys_seg.tier),
        passages=out, question=question, markers=summaries["marker"], turns=summaries["turn"],
    )


# ====================================================================== OpenAI chat and completions
def usage(outcome: QueryOutcome) -> Usage:
    """Prompt tokens, completion tokens of every choice, and the prompt tokens whose KV came from
    the cache (not in the final recomputed set: `context_tokens - recomputed_tokens`)."""
    r = outcome.report
    completion = sum(c.completion_tokens for c in outcome.choices) if outcome.choices else outcome.completion_tokens
    return Usage(prompt_tokens=r.context_tokens, completion_tokens=completion,
                 total_tokens=r.context_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=r.context_tokens - r.recomputed_tokens))


def blend_extra(answered: Answered) -> dict:
    """Chat's `blend` field: the `/v1/query` body's mode, timings, stats and explain, and what
    retrieval searched for and how many earlier messages the prompt kept."""
    body, outcome = answered.body, answered.outcome
    extra = {"mode": body.mode, "timings": body.timings.model_dump(), "stats": body.stats.model_dump(),
             "search": outcome.search, "turns": outcome.turns}
    if isinstance(body, QueryExplainedResponse):
        extra["explain"] = body.explain.model_dump()
    return extra


def openai_extras(answered: Answered) -> dict:
    """Blendserve's fields on an OpenAI response (and on the last stream chunk)."""
    return {"passages": answered.body.passages, "sources": answered.body.sources,
            "notes": list(answered.outcome.notes), "blend": blend_extra(answered)}


def chat_response(answered: Answered, head: dict, logprobs: bool = False) -> ChatCompletionResponse:
    outcome = answered.outcome
    choices = [ChatChoice(index=c.index, message=ChatChoiceMessage(content=c.text), finish_reason=c.finish_reason,
                          logprobs=chat_logprobs(c.logprobs) if logprobs else None) for c in outcome.choices]
    return ChatCompletionResponse(**head, choices=choices, usage=usage(outcome), **openai_extras(answered))


def completion_response(answered: Answered, head: dict, logprobs: bool = False) -> CompletionResponse:
    outcome = answered.outcome
    choices = [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                logprobs=completion_logprobs(c.logprobs) if logprobs else None) for c in outcome.choices]
    return CompletionResponse(**head, choices=choices, usage=usage(outcome), **openai_extras(answered))
