"""Server-sent events, one way for both query endpoints.

`run_to_completion` answers a non-streaming query; `stream_query` submits a streaming one, waits
for its first delta (so an error before any token is still a plain HTTP error) and then streams
the frames an endpoint's `Frames` writes: its opening frames, one per delta, its closing frames,
or an in-band error frame once the headers are sent. Both run the query on the event loop
(`service.QueryRun`, awaiting the engine client) and build its HTTP body with `app.presenters`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

from fastapi.encoders import jsonable_encoder
from fastapi.responses import StreamingResponse

from app.errors import error_body, error_kind
from app.presenters import Answered, present
from app.service import QueryRun, QuerySpec, ServiceError, StreamDelta
from app.state import AppState
from blend_engine.cancel import Cancelled

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


def answered(stack, spec: QuerySpec, run: QueryRun) -> Answered:
    """A finished query's HTTP body."""
    return present(run.outcome(), stack.engine.runner.tokenizer, spec.explain_max_tokens,
                   logprobs=spec.gen.logprobs is not None)


async def start(svc: AppState, spec: QuerySpec, arrival: float | None = None) -> tuple[object, QueryRun]:
    """(the stack, the query submitted to the engine client): the service's errors raise here.
    `arrival`: when the HTTP server got it (`app.timing`)."""
    stack = svc.require_stack()  # the lifespan made the query threads too
    return stack, await QueryRun.start(stack, svc.require_client(), spec, svc.settings.service.request_timeout_s,
                                       arrival, svc.host_work.run)


async def run_to_completion(svc: AppState, spec: QuerySpec, endpoint: str, arrival: float | None = None) -> Answered:
    """A query awaited whole; counted and logged under `endpoint`."""
    stack, run = await start(svc, spec, arrival)
    try:
        await run.finish()
    finally:
        run.abort()  # no-op when finished; drops it from the batch when the client left
    done = answered(stack, spec, run)
    svc.observe(endpoint, done.outcome)
    return done


async def stream_query(svc: AppState, spec: QuerySpec, endpoint: str, frames: Frames,
                       arrival: float | None = None) -> StreamingResponse:
    """A streaming query as an SSE response written by `frames`."""
    stack, run = await start(svc, spec, arrival)
    deltas = run.deltas()
    try:
        first = await anext(deltas, None)  # an error before any token is still a plain HTTP error
    except BaseException:
        run.abort()
        raise

    async def events() -> AsyncIterator[str]:
        try:
            for frame in frames.opening():
                yield frame
            if first is not None:
                yield frames.delta(first)
                async for delta in deltas:
                    yield frames.delta(delta)
            done = answered(stack, spec, run)
            svc.observe(endpoint, done.outcome)
            for frame in frames.closing(done):
                yield frame
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield frames.error(stream_error(exc))
        finally:
            run.abort()  # no-op when finished; drops it from the batch when the client left

    return StreamingResponse(events(), media_type="text/event-stream", headers=STREAM_HEADERS)
