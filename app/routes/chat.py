"""The OpenAI-compatible endpoints: POST /v1/chat/completions (JSON or SSE chunks) and GET /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator

from fastapi import APIRouter

from app.presenters import Answered, blend_extra, chat_response, usage
from app.routes.common import build_spec
from app.schemas import ChatCompletionRequest, ChatCompletionResponse
from app.service import QuerySpec
from app.settings import ServiceSettings
from app.state import State
from app.streaming import run_to_completion, sse, stream_query
from app.validation import check_limits, field_error, reject_surrogates

router = APIRouter(tags=["query"])
ENDPOINT = "/v1/chat/completions"


class ChatFrames:
    """OpenAI `chat.completion.chunk` frames: the role, one per delta, the finish (with Blendserve's
    `passages` and `blend`), the usage when asked for, then `[DONE]`; an error as a bare envelope."""

    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool) -> None:
        self.head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self.include_usage = include_usage

    def _chunk(self, delta: dict, finish: str | None = None, **extra) -> str:
        return sse({**self.head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                    **extra})

    def opening(self) -> Iterable[str]:
        return (self._chunk({"role": "assistant", "content": ""}),)

    def delta(self, text: str) -> str:
        return self._chunk({"content": text})

    def closing(self, answered: Answered) -> Iterator[str]:
        yield self._chunk({}, answered.outcome.finish_reason, passages=answered.body.passages,
                          blend=blend_extra(answered.body))
        if self.include_usage:
            yield sse({**self.head, "choices": [], "usage": usage(answered.outcome)})
        yield sse("[DONE]")

    def error(self, body: dict) -> str:
        return sse(body)


def _chat_spec(s: ServiceSettings, req: ChatCompletionRequest) -> QuerySpec:
    """The last user message is the question; system and developer messages make the system prompt."""
    users = [i for i, m in enumerate(req.messages) if m.role == "user"]
    if not users or not req.messages[users[-1]].text().strip():
        raise field_error(("messages",), "needs a user message with text to answer")
    question = req.messages[users[-1]].text()
    system = "\n\n".join(m.text() for m in req.messages if m.role in ("system", "developer") and m.text().strip())
    max_tokens = req.max_completion_tokens or req.max_tokens or min(256, s.max_new_tokens)
    check_limits(s, question=question, top_k=req.top_k, max_tokens=max_tokens, documents=req.documents,
                 question_loc=("messages", users[-1], "content"))
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return build_spec(s, req, question=question, max_tokens=max_tokens, temperature=req.temperature or 0.0,
                      top_p=req.top_p or 1.0, stop=stop, seed=req.seed, system_prompt=system or None)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}, 400: {}, 413: {}, 422: {}, 503: {}, 504: {}})
async def chat_completions(req: ChatCompletionRequest, svc: State):
    reject_surrogates(req)  # every field, `model` included, before anything is generated
    spec = _chat_spec(svc.settings, req)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = req.model or svc.settings.model
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await stream_query(svc, spec, ENDPOINT, ChatFrames(completion_id, created, model, include_usage))
    answered = await run_to_completion(svc, spec, "chat", ENDPOINT)
    return chat_response(answered, completion_id, created, model)


@router.get("/v1/models")
async def list_models(svc: State) -> dict:
    s = svc.settings
    return {"object": "list", "data": [{"id": s.model, "object": "model", "created": 0, "owned_by": "blendserve"}]}
