"""The one error envelope and the exception handlers that send it.

Every error body is `{"detail": ..., "error": {"message", "type", "code", "param"}}`, built by
`error_body`; `error_response` wraps it in a JSONResponse."""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.service import Busy, NoPassagesYet, RequestTimeout, ServiceError, StorageFault, storage_fault
from blend_engine.cancel import Cancelled
from blend_engine.errors import Overloaded, StorageError
from retrieval.passages import PassageStoreError

logger = logging.getLogger(__name__)


def error_body(message: str, code: str, kind: str = "invalid_request_error", param: str | None = None,
               detail: Any = None) -> dict:
    """The error envelope; `detail` defaults to the message (422s list the pydantic-style errors there)."""
    return {"detail": message if detail is None else detail,
            "error": {"message": message, "type": kind, "code": code, "param": param}}


def error_response(status: int, message: str, code: str, *, param: str | None = None, detail: Any = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The envelope as a response; its type is the caller's fault below 500, the server's from 500."""
    return JSONResponse(error_body(message, code, error_kind(status), param, detail), status_code=status,
                        headers=headers)


def error_kind(status: int) -> str:
    """The envelope's type: the caller's fault below 500, the server's from 500."""
    return "invalid_request_error" if status < 500 else "server_error"


def endpoint_of(request: Request) -> str:
    """The route template (bounded label values), not the raw path."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "other"


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


async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    if not _is_json(request):
        return error_response(415, "the request body must be JSON (content-type: application/json)",
                              "unsupported_media_type")
    errors = [_describe(e) for e in exc.errors()]
    message = "; ".join(f"{e['param'] or 'body'}: {e['msg']}" for e in errors)
    return error_response(422, message, "validation_error", param=errors[0]["param"] if errors else None,
                          detail=[e["detail"] for e in errors])


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, str(exc.detail), code, headers=getattr(exc, "headers", None))


async def _service(request: Request, exc: ServiceError) -> JSONResponse:
    metrics = request.app.state.svc.metrics
    if isinstance(exc, RequestTimeout):
        metrics.timeouts.inc()
    if isinstance(exc, Busy):
        metrics.rejected.inc()
    if isinstance(exc, StorageFault):
        metrics.storage_errors.inc()
        logger.error("%s %s: %s", request.method, endpoint_of(request), exc.message, exc_info=exc.__cause__)
    metrics.requests.labels(endpoint_of(request), str(exc.status_code)).inc()
    response = error_response(exc.status_code, exc.message, exc.code, param=getattr(exc, "param", None),
                              headers=exc.headers)
    if isinstance(exc, NoPassagesYet):  # with the ingestion's progress, so the caller sees when to come back
        body = error_body(exc.message, exc.code, error_kind(exc.status_code))
        body["ingestion"] = await run_in_threadpool(request.app.state.svc.ingestion)
        response = JSONResponse(jsonable_encoder(body), status_code=exc.status_code, headers=exc.headers)
    return response


async def _full(request: Request, exc: Overloaded) -> JSONResponse:
    return await _service(request, Busy(str(exc), exc.retry_after_s))


async def _storage(request: Request, exc: Exception) -> JSONResponse:
    return await _service(request, storage_fault(exc))


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    """Anything unexpected: logged with its traceback, counted, and a JSON 500 (never plain text)."""
    logger.error("%s %s failed", request.method, endpoint_of(request), exc_info=exc)
    request.app.state.svc.metrics.requests.labels(endpoint_of(request), "500").inc()
    return error_response(500, "internal error", "internal_error")


async def _cancelled(request: Request, exc: Cancelled) -> JSONResponse:
    return error_response(503, str(exc), "cancelled", headers={"Retry-After": "1"})


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(ServiceError, _service)
    app.add_exception_handler(Overloaded, _full)
    for kind in (StorageError, PassageStoreError, sqlite3.Error, OSError):
        app.add_exception_handler(kind, _storage)
    app.add_exception_handler(Exception, _internal)
    app.add_exception_handler(Cancelled, _cancelled)
