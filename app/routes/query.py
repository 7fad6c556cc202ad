"""POST /v1/query: the native endpoint, JSON or SSE (`delta` events, then `done` or `error`)."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter

from app.auth import Tenant
from app.presenters import Answered, chat_logprobs, sources_out
from app.routes.common import build_spec
from app.schemas import QueryExplainedResponse, QueryRequest, QueryResponse
from app.service import StreamDelta
from app.state import State
from app.streaming import run_to_completion, sse, stream_query
from app.timing import Arrival
from app.validation import check_limits, field_error, reject_surrogates

router = APIRouter(tags=["query"])
ENDPOINT = "/v1/query"


class QueryFrames:
    """A `sources` event before the first token, `delta` events with the text, a `done` event with the
    whole response, or an `error` event."""

    def opening(self) -> Iterable[str]:
        return ()

    def delta(self, delta: StreamDelta) -> str:
        if delta.sources:
            return sse({"sources": sources_out(delta.sources)}, "sources")
        extra = {"logprobs": chat_logprobs(delta.logprobs).content} if delta.logprobs else {}
        return sse({"text": delta.text, **extra}, "delta")

    def closing(self, answered: Answered) -> Iterable[str]:
        return (sse(answered.body, "done"),)

    def error(self, body: dict) -> str:
        return sse(body, "error")


@router.post("/v1/query", response_model=QueryExplainedResponse | QueryResponse,
             responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"},
                        400: {}, 413: {}, 422: {}, 503: {}, 504: {}})
async def query(req: QueryRequest, svc: State, tenant: Tenant, arrival: Arrival):
    reject_surrogates(req)
    s = svc.settings
    check_limits(s, question=req.question, top_k=req.top_k, max_tokens=req.max_tokens, documents=req.documents)
    if req.top_logprobs is not None and not req.logprobs:
        raise field_error(("top_logprobs",), "needs logprobs: true", req.top_logprobs)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    spec = build_spec(s, req, question=req.question, max_tokens=req.max_tokens, temperature=req.temperature,
                      logprobs=logprobs, tenant=tenant, ignore_eos=req.ignore_eos)
    if req.stream:
        return await stream_query(svc, spec, ENDPOINT, QueryFrames(), arrival)
    answered = await run_to_completion(svc, spec, ENDPOINT, arrival)
    return answered.body
