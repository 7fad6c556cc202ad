"""POST /v1/completions: OpenAI's legacy completions, the prompt answered as a question (with
retrieval and the chat template, like /v1/query), JSON or SSE `text_completion` chunks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fastapi import APIRouter

from app.auth import Tenant
from app.openai_fields import refuse_unsupported
from app.presenters import Answered, completion_logprobs, completion_response, openai_extras, sources_out, usage
from app.routes.common import Head, openai_spec
from app.schemas import CompletionRequest, CompletionResponse
from app.service import StreamDelta
from app.state import State
from app.streaming import run_to_completion, sse, stream_query
from app.timing import Arrival
from app.validation import check_limits, field_error, reject_surrogates

router = APIRouter(tags=["query"])
ENDPOINT = "/v1/completions"


class CompletionFrames:
    """`text_completion` chunks: one per delta, each choice's finish (the last with Blendserve's
    fields), the usage when asked for, then `[DONE]`."""

    def __init__(self, head: Head, include_usage: bool) -> None:
        self.head = head.fields("text_completion")
        self.include_usage = include_usage
        self.offsets: dict[int, int] = {}  # per choice: characters sent so far (the logprobs' text_offset)

    def _chunk(self, index: int, text: str, finish: str | None = None, logprobs=None, **extra) -> str:
        return sse({**self.head, "choices": [{"index": index, "text": text, "finish_reason": finish,
                                              "logprobs": logprobs}], **extra})

    def opening(self) -> Iterable[str]:
        return ()

    def delta(self, delta: StreamDelta) -> str:
        if delta.sources:  # before the first token: an empty chunk carrying Blendserve's `sources`
            return self._chunk(delta.index, "", sources=sources_out(delta.sources))
        offset = self.offsets.get(delta.index, 0)
        self.offsets[delta.index] = offset + len(delta.text)
        logprobs = completion_logprobs(delta.logprobs, offset) if delta.logprobs else None
        return self._chunk(delta.index, delta.text, logprobs=logprobs)

    def closing(self, answered: Answered) -> Iterator[str]:
        choices = answered.outcome.choices
        for c in choices[:-1]:
            yield self._chunk(c.index, "", c.finish_reason)
        yield self._chunk(choices[-1].index, "", choices[-1].finish_reason, **openai_extras(answered))
        if self.include_usage:
            yield sse({**self.head, "choices": [], "usage": usage(answered.outcome)})
        yield sse("[DONE]")

    def error(self, body: dict) -> str:
        return sse(body)


def _prompt(req: CompletionRequest) -> str:
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if len(prompts) != 1:
        raise field_error(("prompt",), "exactly one prompt per request (send a list of one string, or a string)")
    if not prompts[0].strip():
        raise field_error(("prompt",), "must not be empty or whitespace")
    return prompts[0]


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={200: {"content": {"text/event-stream": {}}}, 400: {}, 413: {}, 422: {}, 503: {}, 504: {}})
async def completions(req: CompletionRequest, svc: State, tenant: Tenant, arrival: Arrival):
    reject_surrogates(req)
    refuse_unsupported(req)
    s = svc.settings
    prompt = _prompt(req)
    check_limits(s, question=prompt, top_k=req.top_k, max_tokens=1, documents=req.documents, question_loc=("prompt",))
    spec = openai_spec(s, req, question=prompt, max_tokens=req.max_tokens or 16, logprobs=req.logprobs, tenant=tenant)
    head = Head.new("cmpl", req.model or s.model.name)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await stream_query(svc, spec, ENDPOINT, CompletionFrames(head, include_usage), arrival)
    answered = await run_to_completion(svc, spec, ENDPOINT, arrival)
    return completion_response(answered, head.fields("text_completion"), logprobs=spec.gen.logprobs is not None)
