"""HTTP bodies from the request logic's results: the one place that builds the query response models.

`app.service.run_query` returns domain data (`QueryOutcome`: the answer, `PassageRef`s, the
engine's report and `Explanation`). `present` turns it into the `/v1/query` body once, on the
engine worker thread (explain's token pieces need the tokenizer, which must stay off the event
loop); `/v1/chat/completions` reuses that body for its `passages` and `blend` fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.schemas import (
    ChatChoice,
    ChatChoiceMessage,
    ChatCompletionResponse,
    Explain,
    PassageExplain,
    PassageOut,
    QueryExplainedResponse,
    QueryResponse,
    QueryStats,
    QuestionExplain,
    SystemExplain,
    Timings,
    Usage,
)
from app.service import PassageRef, QueryOutcome
from blend_engine.explain import Explanation, SegmentExplanation, token_pieces


@dataclass(frozen=True)
class Answered:
    """A finished query (for metrics and logs) and its `/v1/query` body (for either endpoint)."""

    outcome: QueryOutcome
    body: QueryResponse


def present(outcome: QueryOutcome, tokenizer: Any, explain_max_tokens: int) -> Answered:
    """The outcome with its HTTP body. Runs on the worker thread (the tokenizer decodes explain's tokens)."""
    explain = (explain_response(tokenizer, outcome.explanation, outcome.passages, explain_max_tokens)
               if outcome.explanation is not None else None)
    return Answered(outcome, query_response(outcome, explain))


def passages_out(refs: Sequence[PassageRef]) -> list[PassageOut]:
    return [PassageOut(id=p.id, title=p.title, score=p.score, doc_id=p.doc_id, location=p.location) for p in refs]


def query_response(outcome: QueryOutcome, explain: Explain | None = None) -> QueryResponse:
    """The `/v1/query` body (`QueryExplainedResponse` when the request asked for explain)."""
    r = outcome.report
    extra = {"explain": explain} if explain is not None else {}
    return (QueryExplainedResponse if extra else QueryResponse)(
        **extra,
        answer=outcome.answer,
        passages=passages_out(outcome.passages),
        mode=r.mode,
        finish_reason=outcome.finish_reason,
        timings=Timings(
            retrieval_ms=round(outcome.retrieval_ms, 3),
            kv_load_ms=round(r.load_ms, 3),
            recompute_ms=round(r.recompute_ms, 3),
            ttft_ms=round(outcome.ttft_ms, 3),
            total_ms=round(outcome.total_ms, 3),
            queue_ms=round(outcome.queue_ms, 3),
            kv_store_ms=round(outcome.store_ms, 3),
        ),
        stats=QueryStats(
            context_tokens=r.context_tokens,
            recomputed_tokens=r.recomputed_tokens,
            recompute_ratio=r.recompute_ratio,
            cache_hits=r.cache_hits,
            cache_misses=r.cache_misses,
            ratio_source=r.ratio_source,
            completion_tokens=outcome.completion_tokens,
            fallback=outcome.fallback,
        ),
    )


def explain_response(tokenizer: Any, ex: Explanation, passages: Sequence[PassageRef], max_tokens: int) -> Explain:
    """The engine's explanation as the API shows it: token text pieces, at most `max_tokens` listed
    (passages then the question, in prompt order); counts always cover every token."""
    sys_seg, *middle, q_seg = ex.segments
    budget = max_tokens

    def take(seg: SegmentExplanation) -> int:
        nonlocal budget
        n = min(len(seg.token_ids), budget)
        budget -= n
        return n

    out = []
    for i, (seg, meta) in enumerate(zip(middle, passages)):
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
        passages=out, question=question,
    )


# ====================================================================== OpenAI chat
def usage(outcome: QueryOutcome) -> Usage:
    prompt = outcome.report.context_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=outcome.completion_tokens,
                 total_tokens=prompt + outcome.completion_tokens)


def blend_extra(body: QueryResponse) -> dict:
    """Chat's `blend` field: the `/v1/query` body's mode, timings, stats and explain."""
    extra = {"mode": body.mode, "timings": body.timings.model_dump(), "stats": body.stats.model_dump()}
    if isinstance(body, QueryExplainedResponse):
        extra["explain"] = body.explain.model_dump()
    return extra


def chat_response(answered: Answered, completion_id: str, created: int, model: str) -> ChatCompletionResponse:
    outcome = answered.outcome
    return ChatCompletionResponse(
        id=completion_id, created=created, model=model,
        choices=[ChatChoice(message=ChatChoiceMessage(content=outcome.answer), finish_reason=outcome.finish_reason)],
        usage=usage(outcome), passages=answered.body.passages, blend=blend_extra(answered.body),
    )
