"""The HTTP service: thin routes over a `Stack` built in the lifespan.

`create_app(settings, stack_factory)` returns a FastAPI app. Heavy objects (model, index, KV
store) are built by `stack_factory` on a start-up thread once the lifespan begins; until then
/healthz answers and /readyz says 503. Engine work always runs on `EngineWorker` threads behind
a bounded queue, never on the event loop.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.auth import BearerAuthMiddleware, token_matches
from app.limits import BodySizeLimitMiddleware
from app.metrics import Metrics
from app.schemas import (
    ChatChoice,
    ChatChoiceMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Health,
    IngestRequest,
    IngestResponse,
    InlineDocument,
    QueryExplainedResponse,
    QueryRequest,
    QueryResponse,
    Readiness,
    Usage,
)
from app.service import (
    BadRequest,
    NotReady,
    QueryOutcome,
    QuerySpec,
    RequestTimeout,
    ServiceError,
    StorageFault,
    StreamHandle,
    run_job,
    run_query,
    storage_fault,
)
from app.startup import build_and_warm
from app.validation import reject_surrogates
from app.worker import Cancelled, EngineWorker, QueueFull
from blend_engine.errors import StorageError
from blend_engine.types import GenerationConfig, Mode
from blendserve_config import logsafe
from blendserve_config.settings import Settings
from blendserve_config.stack import Stack, build_stack
from corpus_tools.documents import Document
from corpus_tools.pipeline import DocumentRejected
from retrieval.passages import PassageStoreError

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
StackFactory = Callable[[Settings], Stack]


# ====================================================================== app state
class AppState:
    """Everything the routes need, hung on `app.state.svc`."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.worker: EngineWorker | None = None
        self.stack: Stack | None = None
        self.ready = False
        self.error: str | None = None
        self.closing = threading.Event()

    def require_stack(self) -> Stack:
        if self.error is not None:
            raise NotReady(f"start-up failed: {self.error}")
        if not self.ready or self.stack is None or self.worker is None:
            raise NotReady("the model, index and KV store are still loading")
        return self.stack


def _svc(request: Request) -> AppState:
    return request.app.state.svc


# ====================================================================== validation helpers
def _field_error(loc: tuple, msg: str, value: Any = None) -> RequestValidationError:
    return RequestValidationError([{"type": "value_error", "loc": ("body", *loc), "msg": msg, "input": value}])


def check_limits(settings: Settings, *, question: str, top_k: int, max_tokens: int,
                 documents: list[InlineDocument] | None, question_loc: tuple = ("question",)) -> None:
    """Limits that depend on Settings; 422 naming the field."""
    if len(question) > settings.max_question_chars:
        raise _field_error(question_loc, f"question is {len(question)} characters; the limit is "
                                         f"{settings.max_question_chars}")
    if documents is None and top_k > settings.max_top_k:  # top_k is unused when the caller brings documents
        raise _field_error(("top_k",), f"top_k must be at most {settings.max_top_k}", top_k)
    if max_tokens > settings.max_new_tokens:
        raise _field_error(("max_tokens",), f"max_tokens must be at most {settings.max_new_tokens}", max_tokens)
    _check_documents(settings, documents)


def _check_documents(settings: Settings, documents) -> None:
    if documents is None:
        return
    if len(documents) > settings.max_documents:
        raise _field_error(("documents",), f"{len(documents)} documents; the limit is {settings.max_documents}")
    for i, doc in enumerate(documents):
        if doc.title is not None and len(doc.title) > settings.max_title_chars:
            raise _field_error(("documents", i, "title"), f"title is {len(doc.title)} characters; the limit is "
                                                          f"{settings.max_title_chars}")
        if len(doc.text) > settings.max_document_chars:
            raise _field_error(("documents", i, "text"), f"document text is {len(doc.text)} characters; the limit "
                                                         f"is {settings.max_document_chars}")


def _gen_config(max_tokens: int, temperature: float, top_p: float = 1.0, stop=(), seed: int | None = None):
    return GenerationConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=tuple(stop), seed=seed)


# ====================================================================== SSE helpers
def _sse(data: Any, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(jsonable_encoder(data), separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


def _error_body(message: str, code: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"detail": message, "error": {"message": message, "type": kind, "code": code, "param": param}}


_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _start_stream(svc: AppState, spec: QuerySpec) -> tuple[StreamHandle, str | None, QueryOutcome | None]:
    """Submit a streaming query and wait for its first delta, so early errors stay HTTP errors."""
    stack = svc.require_stack()
    handle = StreamHandle(svc.worker, lambda job, emit: run_query(stack, spec, job, emit),
                          svc.settings.request_timeout_s, "query-stream")
    try:
        first = await handle.first()
        outcome = handle.result() if first is None else None
    except BaseException:
        handle.cancel()
        raise
    return handle, first, outcome


async def _deltas(handle: StreamHandle, first: str | None) -> AsyncIterator[str]:
    if first is not None:
        yield first
        async for delta in handle.rest():
            yield delta


def _stream_error(exc: BaseException) -> dict:
    if isinstance(exc, ServiceError):
        return _error_body(exc.message, exc.code)
    if isinstance(exc, Cancelled):
        return _error_body(str(exc), "cancelled", "server_error")
    logger.exception("streaming request failed", exc_info=exc)
    return _error_body("internal error", "internal_error", "server_error")


# ====================================================================== routes
page = APIRouter(include_in_schema=False)
health = APIRouter(tags=["health"])
api = APIRouter(tags=["query"])
docs = APIRouter(tags=["documents"])
ops = APIRouter(tags=["operations"])


@page.get("/", response_class=FileResponse)
async def index() -> FileResponse:
    """The web page (app/static): ask, watch the answer stream in, see what was recomputed."""
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


@health.get("/healthz", response_model=Health)
async def healthz() -> Health:
    return Health(status="ok")


async def _readiness(svc: AppState) -> JSONResponse:
    """Ready or not, with the model, index and store details (the data dir, counts, store stats)."""
    if svc.error is not None or not svc.ready:
        body = Readiness(ready=False, status="error" if svc.error else "starting", error=svc.error,
                         reason="start-up failed" if svc.error else "the model, index and KV store are loading")
        return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": "5"})
    stack = svc.stack
    index, store = await run_in_threadpool(lambda: (stack.pipeline.stats(), stack.store.stats().as_dict()))
    gate = getattr(stack, "gate", None)
    body = Readiness(ready=True, status="ready", model=getattr(stack.engine.runner, "name", svc.settings.model),
                     index=jsonable_encoder(index), store=jsonable_encoder(store), sync=_sync_status(stack),
                     fidelity=None if gate is None else jsonable_encoder(gate.as_dict()))
    return JSONResponse(body.model_dump())


@health.get("/readyz", response_model=Readiness, response_model_exclude_none=True,
            responses={503: {"model": Readiness}})
async def readyz(request: Request) -> JSONResponse:
    """With BLENDSERVE_API_KEY set, callers without the key get only ready, status and reason;
    the details are at the authenticated GET /v1/status."""
    svc = _svc(request)
    key = svc.settings.api_key
    if key and not token_matches(request.headers.get("authorization"), key):
        ready = svc.ready and svc.error is None
        status = "ready" if ready else ("error" if svc.error else "starting")
        reason = None if ready else ("start-up failed; details at /v1/status" if svc.error
                                     else "the model, index and KV store are loading")
        body = {"ready": ready, "status": status, **({"reason": reason} if reason else {})}
        return JSONResponse(body, status_code=200 if ready else 503, headers=None if ready else {"Retry-After": "5"})
    return await _readiness(svc)


@ops.get("/v1/status", response_model=Readiness, responses={503: {"model": Readiness}})
async def status(request: Request) -> JSONResponse:
    """/readyz with every detail (the same body /readyz gives when no API key is set)."""
    return await _readiness(_svc(request))


@ops.get("/v1/verify")
async def verify(request: Request) -> dict:
    """Check every passage's KV and the index against the passage store (no repair); names documents whose
    ingestion did not finish (`incomplete`). Runs on the engine queue."""
    svc = _svc(request)
    stack = svc.require_stack()
    report = await run_job(svc.worker, lambda job: stack.pipeline.verify(repair=False), svc.settings.request_timeout_s,
                           "verify")
    return {"ok": report.ok, "passages": report.passages, "kv_ok": report.kv_ok, "problems": list(report.problems),
            "incomplete": list(report.incomplete), "index_missing": report.index_missing,
            "index_extra": report.index_extra}


@api.post("/v1/query", response_model=QueryExplainedResponse | QueryResponse,
          responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"},
                     400: {}, 413: {}, 422: {}, 503: {}, 504: {}})
async def query(req: QueryRequest, request: Request):
    reject_surrogates(req)
    svc = _svc(request)
    s = svc.settings
    check_limits(s, question=req.question, top_k=req.top_k, max_tokens=req.max_tokens, documents=req.documents)
    spec = QuerySpec(
        question=req.question, top_k=req.top_k,
        documents=tuple(req.documents) if req.documents is not None else None,
        mode=Mode.parse(req.mode or s.default_mode), recompute_ratio=_ratio(req.recompute_ratio, s),
        gen=_gen_config(req.max_tokens, req.temperature),
        explain=req.explain, explain_max_tokens=s.explain_max_tokens,
    )
    if not req.stream:
        stack = svc.require_stack()
        outcome: QueryOutcome = await run_job(svc.worker, lambda job: run_query(stack, spec, job),
                                              s.request_timeout_s, "query")
        _observe(svc, "/v1/query", outcome)
        return outcome.response()

    handle, first, done = await _start_stream(svc, spec)

    async def events() -> AsyncIterator[str]:
        try:
            async for delta in _deltas(handle, first):
                yield _sse({"text": delta}, "delta")
            outcome = done or handle.result()
            _observe(svc, "/v1/query", outcome)
            yield _sse(outcome.response(), "done")
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield _sse(_stream_error(exc), "error")
        finally:
            handle.cancel()  # no-op when finished; frees the worker when the client left

    return StreamingResponse(events(), media_type="text/event-stream", headers=_STREAM_HEADERS)


@api.post("/v1/chat/completions", response_model=ChatCompletionResponse,
          responses={200: {"content": {"text/event-stream": {}}}, 400: {}, 413: {}, 422: {}, 503: {}, 504: {}})
async def chat_completions(req: ChatCompletionRequest, request: Request):
    reject_surrogates(req)  # every field, `model` included, before anything is generated
    svc = _svc(request)
    s = svc.settings
    users = [i for i, m in enumerate(req.messages) if m.role == "user"]
    if not users or not req.messages[users[-1]].text().strip():
        raise _field_error(("messages",), "needs a user message with text to answer")
    question = req.messages[users[-1]].text()
    system = "\n\n".join(m.text() for m in req.messages if m.role in ("system", "developer") and m.text().strip())
    max_tokens = req.max_completion_tokens or req.max_tokens or min(256, s.max_new_tokens)
    check_limits(s, question=question, top_k=req.top_k, max_tokens=max_tokens, documents=req.documents,
                 question_loc=("messages", users[-1], "content"))
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    spec = QuerySpec(
        question=question, top_k=req.top_k,
        documents=tuple(req.documents) if req.documents is not None else None,
        mode=Mode.parse(req.mode or s.default_mode), recompute_ratio=_ratio(req.recompute_ratio, s),
        gen=_gen_config(max_tokens, req.temperature or 0.0, req.top_p or 1.0, stop, req.seed),
        system_prompt=system or None,
        explain=req.explain, explain_max_tokens=s.explain_max_tokens,
    )
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = req.model or s.model

    if not req.stream:
        stack = svc.require_stack()
        outcome: QueryOutcome = await run_job(svc.worker, lambda job: run_query(stack, spec, job),
                                              s.request_timeout_s, "chat")
        _observe(svc, "/v1/chat/completions", outcome)
        return ChatCompletionResponse(
            id=completion_id, created=created, model=model,
            choices=[ChatChoice(message=ChatChoiceMessage(content=outcome.answer), finish_reason=outcome.finish_reason)],
            usage=_usage(outcome), passages=outcome.passages, blend=_blend_extra(outcome),
        )

    handle, first, done = await _start_stream(svc, spec)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}

    async def events() -> AsyncIterator[str]:
        try:
            yield _sse(chunk({"role": "assistant", "content": ""}))
            async for delta in _deltas(handle, first):
                yield _sse(chunk({"content": delta}))
            outcome = done or handle.result()
            _observe(svc, "/v1/chat/completions", outcome)
            yield _sse(chunk({}, outcome.finish_reason, passages=outcome.passages, blend=_blend_extra(outcome)))
            if include_usage:
                yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [], "usage": _usage(outcome)})
            yield _sse("[DONE]")
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
            yield _sse(_stream_error(exc))
        finally:
            handle.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers=_STREAM_HEADERS)


@api.get("/v1/models")
async def list_models(request: Request) -> dict:
    s = _svc(request).settings
    return {"object": "list", "data": [{"id": s.model, "object": "model", "created": 0, "owned_by": "blendserve"}]}


@docs.post("/v1/documents", response_model=IngestResponse, status_code=201,
           responses={400: {}, 413: {}, 422: {}, 503: {}, 504: {}})
async def ingest_documents(req: IngestRequest, request: Request) -> IngestResponse:
    """All or nothing: the documents become visible together at the end, unless the request fails or
    times out first (then nothing is committed). Re-ingesting a doc_id replaces that document."""
    reject_surrogates(req)
    svc = _svc(request)
    _check_documents(svc.settings, req.documents)
    stack = svc.require_stack()
    docs_in = [Document(text=d.text, title=d.title, doc_id=d.doc_id, source="api") for d in req.documents]

    def ingest(job):
        return stack.pipeline.ingest(docs_in, progress=False, publish="request", before_commit=job.begin_commit,
                                     strict=True)

    try:
        summary = await run_job(svc.worker, ingest, svc.settings.request_timeout_s, "ingest")
    except DocumentRejected as exc:
        raise _field_error(("documents", exc.index, exc.field), exc.message) from None
    body = IngestResponse(**_as_dict(summary))
    svc.metrics.ingested.inc(body.new_passages)
    if body.errors and not body.doc_ids:
        raise BadRequest(f"nothing was ingested: {body.errors}")
    return body


@docs.get("/v1/documents/{doc_id:path}", responses={404: {}})
async def get_document(doc_id: str, request: Request) -> dict:
    stack = _svc(request).require_stack()
    doc = await run_in_threadpool(stack.pipeline.get_document, doc_id)
    if doc is None:
        return _not_found(doc_id)
    return jsonable_encoder(doc)


@docs.delete("/v1/documents/{doc_id:path}", status_code=204, responses={404: {}})
async def delete_document(doc_id: str, request: Request) -> Response:
    stack = _svc(request).require_stack()
    if not await run_in_threadpool(stack.pipeline.delete_document, doc_id):
        return _not_found(doc_id)
    return Response(status_code=204)


@ops.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    registry = _svc(request).metrics.registry
    return Response(await run_in_threadpool(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)


# ====================================================================== small helpers
def _sync_status(stack: Stack) -> dict | None:
    """This replica's index against the passage store: generation, head, lag, the store it follows."""
    sync = getattr(stack, "sync", None)
    if sync is None:
        return None
    return {**sync.status().as_dict(), "passage_store": stack.pipeline.db.describe(), "vectors": len(sync.index),
            "start": sync.start_info}


def _ratio(requested: float | None, settings: Settings) -> float | None:
    return requested if requested is not None else settings.recompute_ratio


def _not_found(doc_id: str) -> JSONResponse:
    return JSONResponse(_error_body(f"document {doc_id!r} not found", "not_found"), status_code=404)


def _as_dict(obj) -> dict:
    if is_dataclass(obj):
        return asdict(obj)
    if isinstance(obj, dict):
        return dict(obj)
    return dict(vars(obj))


def _usage(outcome: QueryOutcome) -> Usage:
    prompt = outcome.report.context_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=outcome.completion_tokens,
                 total_tokens=prompt + outcome.completion_tokens)


def _blend_extra(outcome: QueryOutcome) -> dict:
    r = outcome.response()
    extra = {"mode": r.mode, "timings": r.timings.model_dump(), "stats": r.stats.model_dump()}
    if isinstance(r, QueryExplainedResponse):
        extra["explain"] = r.explain.model_dump()
    return extra


def _endpoint(request: Request) -> str:
    """The route template (bounded label values), not the raw path."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "other"


def _observe(svc: AppState, endpoint: str, outcome: QueryOutcome) -> None:
    svc.metrics.observe_query(outcome.report, outcome.ttft_ms, outcome.total_ms)
    if outcome.fallback:
        svc.metrics.blend_fallbacks.inc()
    svc.metrics.requests.labels(endpoint, "200").inc()
    logger.info("%s mode=%s passages=%d hits=%d misses=%d recomputed=%d/%d ttft=%.1fms total=%.1fms", endpoint,
                outcome.report.mode, len(outcome.passages), outcome.report.cache_hits, outcome.report.cache_misses,
                outcome.report.recomputed_tokens, outcome.report.context_tokens, outcome.ttft_ms, outcome.total_ms)


# ====================================================================== error handlers
def _is_json(request: Request) -> bool:
    """A body sent as JSON, or with no content type (FastAPI then parses it as JSON too)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return request.method not in ("POST", "PUT", "PATCH") or not ctype or ctype == "application/json" \
        or ctype.endswith("+json")


def _describe(err: dict) -> dict:
    """One validation error as {param, msg, detail}. The offending input is not echoed: it may be
    huge (a 200 KB question) or not representable in JSON (NaN, Infinity)."""
    loc = [x for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        at = f" at character {loc[0]}" if loc else ""
        ctx = (err.get("ctx") or {}).get("error")
        return {"param": None, "msg": f"invalid JSON{at}" + (f": {ctx}" if ctx else ""),
                "detail": {"type": "json_invalid", "loc": ["body", *loc], "msg": err.get("msg", "")}}
    param = ".".join(str(x) for x in loc) or None
    msg = err.get("msg", "invalid")
    if "unable to parse raw data as a unicode string" in msg:  # pydantic's words for a lone surrogate
        msg = "contains a lone UTF-16 surrogate (invalid Unicode text)"
    detail = {"type": err.get("type"), "loc": ["body", *loc], "msg": msg}
    return {"param": param, "msg": detail["msg"], "detail": detail}


def _install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if not _is_json(request):
            msg = "the request body must be JSON (content-type: application/json)"
            return JSONResponse(_error_body(msg, "unsupported_media_type"), status_code=415)
        errors = [_describe(e) for e in exc.errors()]
        message = "; ".join(f"{e['param'] or 'body'}: {e['msg']}" for e in errors)
        body = {"detail": [e["detail"] for e in errors],
                "error": {"message": message, "type": "invalid_request_error", "code": "validation_error",
                          "param": errors[0]["param"] if errors else None}}
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code, "http_error")
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(_error_body(str(exc.detail), code, kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ServiceError)
    async def _service(request: Request, exc: ServiceError) -> JSONResponse:
        if isinstance(exc, RequestTimeout):
            request.app.state.svc.metrics.timeouts.inc()
        if isinstance(exc, StorageFault):
            request.app.state.svc.metrics.storage_errors.inc()
            logger.error("%s %s: %s", request.method, _endpoint(request), exc.message, exc_info=exc.__cause__)
        request.app.state.svc.metrics.requests.labels(_endpoint(request), str(exc.status_code)).inc()
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(_error_body(exc.message, exc.code, kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(QueueFull)
    async def _full(request: Request, exc: QueueFull) -> JSONResponse:
        svc = request.app.state.svc
        svc.metrics.rejected.inc()
        svc.metrics.requests.labels(_endpoint(request), "503").inc()
        return JSONResponse(_error_body(str(exc), "overloaded", "server_error"), status_code=503,
                            headers={"Retry-After": "1"})

    async def _storage(request: Request, exc: Exception) -> JSONResponse:
        return await _service(request, storage_fault(exc))

    for kind in (StorageError, PassageStoreError, sqlite3.Error, OSError):
        app.add_exception_handler(kind, _storage)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        """Anything unexpected: logged with its traceback, counted, and a JSON 500 (never plain text)."""
        logger.error("%s %s failed", request.method, _endpoint(request), exc_info=exc)
        request.app.state.svc.metrics.requests.labels(_endpoint(request), "500").inc()
        return JSONResponse(_error_body("internal error", "internal_error", "server_error"), status_code=500)

    @app.exception_handler(Cancelled)
    async def _cancelled(request: Request, exc: Cancelled) -> JSONResponse:
        return JSONResponse(_error_body(str(exc), "cancelled", "server_error"), status_code=503,
                            headers={"Retry-After": "1"})


# ====================================================================== the app
def create_app(settings: Settings | None = None, stack_factory: StackFactory | None = None) -> FastAPI:
    settings = settings or Settings()
    factory = stack_factory or build_stack
    logsafe.install()
    metrics_ = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc: AppState = app.state.svc
        svc.worker = EngineWorker(settings.workers, settings.max_queue)
        metrics_.bind_worker(svc.worker)
        starter = threading.Thread(target=build_and_warm, args=(svc, factory), name="blendserve-startup", daemon=True)
        starter.start()
        try:
            yield
        finally:
            svc.closing.set()
            svc.ready = False
            await run_in_threadpool(svc.worker.close)
            stack, svc.stack = svc.stack, None
            if stack is not None:
                await run_in_threadpool(stack.close)
            logger.info("shut down")

    app = FastAPI(
        title="Blendserve",
        version="0.1.0",
        summary="RAG question answering that reuses each passage's KV cache wherever it lands (CacheBlend).",
        lifespan=lifespan,
    )
    app.state.svc = AppState(settings, metrics_)
    metrics_.bind_store(lambda: app.state.svc.stack.store if app.state.svc.stack is not None else None)
    metrics_.bind_sync(lambda: getattr(app.state.svc.stack, "sync", None))
    _install_handlers(app)
    for router in (page, health, api, docs, ops):
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    # outermost first: size limit, then auth (both pure ASGI, streaming untouched)
    app.add_middleware(BearerAuthMiddleware, api_key=settings.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    return app
