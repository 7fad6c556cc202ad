"""The OpenAI-compatible endpoints: POST /v1/chat/completions (JSON or SSE chunks) and GET /v1/models."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fastapi import APIRouter

from app.auth import Tenant
from app.conversation import ConversationError, from_messages
from app.openai_fields import message_texts, refuse_unsupported
from app.presenters import Answered, chat_logprobs, chat_response, openai_extras, sources_out, usage
from app.routes.common import Head, openai_spec
from app.schemas import ChatCompletionRequest, ChatCompletionResponse
from app.service import QuerySpec, StreamDelta
from app.settings import ServiceSettings
from app.state import State
from app.streaming import run_to_completion, sse, stream_query
from app.timing import Arrival
from app.validation import check_limits, field_error, reject_surrogates

router = APIRouter(tags=["query"])
ENDPOINT = "/v1/chat/completions"


class ChatFrames:
    """OpenAI `chat.completion.chunk` frames: per choice its role, one per delta, its finish; the
    last finish carries Blendserve's `passages`, `sources`, `notes` and `blend` (the sources also in an empty
    chunk before the first token); the usage when asked
    for, then `[DONE]`; an error as a bare envelope."""

    def __init__(self, head: Head, n: int, include_usage: bool) -> None:
        self.head = head.fields("chat.completion.chunk")
        self.n = n
        self.include_usage = include_usage

    def _chunk(self, index: int, delta: dict, finish: str | None = None, logprobs=None, **extra) -> str:
        return sse({**self.head, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                              "logprobs": logprobs}], **extra})

    def opening(self) -> Iterable[str]:
        return tuple(self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n))

    def delta(self, delta: StreamDelta) -> str:
        if delta.sources:  # before the first token: an empty delta carrying Blendserve's `sources`
            return self._chunk(delta.index, {}, sources=sources_out(delta.sources))
        logprobs = chat_logprobs(delta.logprobs) if delta.logprobs else None
        return self._chunk(delta.index, {"content": delta.text}, logprobs=logprobs)

    def closing(self, answered: Answered) -> Iterator[str]:
        choices = answered.outcome.choices
        for c in choices[:-1]:
            yield self._chunk(c.index, {}, c.finish_reason)
        yield self._chunk(choices[-1].index, {}, choices[-1].finish_reason, **openai_extras(answered))
        if self.include_usage:
            yield sse({**self.head, "choices": [], "usage": usage(answered.outcome)})
        yield sse("[DONE]")

    def error(self, body: dict) -> str:
        return sse(body)


def _chat_spec(s: ServiceSettings, req: ChatCompletionRequest, tenant: str | None) -> QuerySpec:
    """The latest user message is the question, the earlier ones its conversation (`app.conversation`);
    system and developer messages make the system prompt."""
    refuse_unsupported(req)
    try:
        conv = from_messages(message_texts(req.messages))
    except ConversationError as exc:
        raise field_error(exc.loc, str(exc)) from None
    check_limits(s, question=conv.question, top_k=req.top_k, max_tokens=1, documents=req.documents,
                 question_loc=("messages", conv.question_index, "content"))
    if req.top_logprobs is not None and not req.logprobs:
        raise field_error(("top_logprobs",), "needs logprobs: true", req.top_logprobs)
    return openai_spec(s, req, question=conv.question, max_tokens=req.max_completion_tokens or req.max_tokens,
                       logprobs=(req.top_logprobs or 0) if req.logprobs else None, system_prompt=conv.system,
                       turns=conv.turns, search=conv.search, tenant=tenant)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}, 400: {}, 413: {}, 422: {}, 503: {}, 504: {}})
async def chat_completions(req: ChatCompletionRequest, svc: State, tenant: Tenant, arrival: Arrival):
    reject_surrogates(req)  # every field, `model` included, before anything is generated
    spec = _chat_spec(svc.settings, req, tenant)
    head = Head.new("chatcmpl", req.model or svc.settings.model.name)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await stream_query(svc, spec, ENDPOINT, ChatFrames(head, spec.n, include_usage), arrival)
    answered = await run_to_completion(svc, spec, ENDPOINT, arrival)
    return chat_response(answered, head.fields("chat.completion"), logprobs=spec.gen.logprobs is not None)


@router.get("/v1/models")
async def list_models(svc: State) -> dict:
    s = svc.settings
    return {"object": "list", "data": [{"id": s.model.name, "object": "model", "created": 0, "owned_by": "blendserve"}]}
