"""Server-sent events, one way for both query endpoints.

`run_to_completion` answers a non-streaming query; `stream_query` submits a streaming one, waits
for its first delta (so an error before any token is still a plain HTTP error) and then streams
the frames an endpoint's `Frames` writes: its opening frames, one per delta, its closing frames,
or an in-band error frame once the headers are sent. Both run the same worker job, `answer`: the
query, then its HTTP body (`app.presenters`), so the tokenizer work never runs on the event loop."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

from fastapi.encoders import jsonable_encoder
from fastapi.responses import StreamingResponse

from app.errors import error_body, error_kind
from app.presenters import Answered, present
from app.service import QuerySpec, ServiceError, StreamDelta, StreamHandle, run_job, run_query
from app.state import AppState
from app.worker import Cancelled, Job

logger = logging.getLogger(__name__)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any, event: str | None = None) -> str:
    """One SSE frame: a string as is (e.g. "[DONE]"), anything else as compact JSON."""
    payload = data if isinstance(data, str) else json.dumps(jsonable_encoder(data), separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


def stream_error(exc: BaseException) -> dict:
    """The error envelope for a failure after the headers were sent."""
    if isinstance(exc, ServiceError):
        return error_body(exc.message, exc.code, error_kind(exc.status_code), getattr(exc, "param", None))
    if isinstance(exc, Cancelled):
        return error_body(str(exc), "cancelled", "server_error")
    logger.exception("streaming request failed", exc_info=exc)
    return error_body("internal error", "internal_error", "server_error")


class Frames(Protocol):
    """How one endpoint writes its stream."""

    def opening(self) -> Iterable[str]: ...

    def delta(self, delta: StreamDelta) -> str: ...

    def closing(self, answered: Answered) -> Iterable[str]: ...

    def error(self, body: dict) -> str: ...


def answer(stack, spec: QuerySpec, job: Job, emit: Callable[[StreamDelta], None] | None = None) -> Answered:
    """The worker job of both query endpoints: run the query, then build its HTTP body."""
    return present(run_query(stack, spec, job, emit), stack.engine.runner.tokenizer, spec.explain_max_tokens,
                   logprobs=spec.gen.logprobs is not None)


async def run_to_completion(svc: AppState, spec: QuerySpec, name: str, endpoint: str) -> Answered:
    """A query run on the engine queue and awaited whole; counted and logged under `endpoint`."""
    stack = svc.require_stack()
    answered: Answered = await run_job(svc.worker, lambda job: answer(stack, spec, job),
                                       svc.settings.service.request_timeout_s, name)
    svc.observe(endpoint, answered.outcome)
    return answered


async def stream_query(svc: AppState, spec: QuerySpec, endpoint: str, frames: Frames) -> StreamingResponse:
    """A streaming query as an SSE response written by `frames`."""
    stack = svc.require_stack()
    handle = StreamHandle(svc.worker, lambda job, emit: answer(stack, spec, job, emit),
                          svc.settings.service.request_timeout_s, "query-stream")
    try:
        first = await handle.first()
        done = handle.result() if first is None else None
    except BaseException:
        handle.cancel()
        raise

    async def events() -> AsyncIterator[str]:
        try:
            for frame in frames.opening():
                yield frame
            if first is not None:
                yield frames.delta(first)
                async for delta in handle.rest():
                    yield frames.delta(delta)
            answered: Answered = done or handle.result()
            svc.observe(endpoint, answered.outcome)
            for frame in frames.closing(answered):
                yield frame
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield frames.error(stream_error(exc))
        finally:
            handle.cancel()  # no-op when finished; frees the worker when the client left

    return StreamingResponse(events(), media_type="text/event-stream", headers=STREAM_HEADERS)
