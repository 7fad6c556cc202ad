"""Health and operations: /healthz, /readyz, /v1/status, /v1/verify, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from app.auth import Keyring
from app.schemas import Health, Readiness
from app.service import run_job
from app.state import AppState, ReadyStack, State
from blendserve_config.stack import Stack

health = APIRouter(tags=["health"])
router = APIRouter(tags=["operations"])

_LOADING = "the model, index and KV store are loading"


@health.get("/healthz", response_model=Health)
async def healthz() -> Health:
    return Health(status="ok")


def _sync_status(stack: Stack) -> dict | None:
    """This replica's index against the passage store: generation, head, lag, the store it follows."""
    sync = getattr(stack, "sync", None)
    if sync is None:
        return None
    return {**sync.status().as_dict(), "passage_store": stack.pipeline.db.describe(), "vectors": len(sync.index),
            "start": sync.start_info}


async def _readiness(svc: AppState) -> JSONResponse:
    """Ready or not, with the model, index and store details (the data dir, counts, store stats)."""
    if svc.error is not None or not svc.ready:
        body = Readiness(ready=False, status="error" if svc.error else "starting", error=svc.error,
                         reason="start-up failed" if svc.error else _LOADING, blend=svc.blend())
        return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": "5"})
    problem = await svc.decoder_problem()
    if problem is not None:
        body = Readiness(ready=False, status="decoder_unavailable", reason=problem, blend=svc.blend())
        return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": "5"})
    stack = svc.stack
    index, store = await run_in_threadpool(lambda: (stack.pipeline.stats(), stack.store.stats().as_dict()))
    gate = getattr(stack, "gate", None)
    body = Readiness(ready=True, status="ready", model=getattr(stack.engine.runner, "name", svc.settings.model.name),
                     index=jsonable_encoder(index), store=jsonable_encoder(store), sync=_sync_status(stack),
                     fidelity=None if gate is None else jsonable_encoder(gate.as_dict()), blend=svc.blend(),
                     ingestion=await run_in_threadpool(svc.ingestion))
    return JSONResponse(body.model_dump())


@health.get("/readyz", response_model=Readiness, response_model_exclude_none=True,
            responses={503: {"model": Readiness}})
async def readyz(request: Request, svc: State) -> JSONResponse:
    """With BLENDSERVE_AUTH_API_KEY (or TENANT_KEYS) set, callers without a key get only ready, status and
    reason; the details are at the authenticated GET /v1/status."""
    keyring = Keyring(svc.settings.auth.api_key, svc.settings.auth.tenant_keys)
    if keyring.enabled and not keyring.match(request.headers.get("authorization"))[0]:
        ready = svc.ready and svc.error is None
        problem = await svc.decoder_problem() if ready else None
        status = "ready" if ready and problem is None else ("error" if svc.error else "starting")
        reason = None if ready else ("start-up failed; details at /v1/status" if svc.error else _LOADING)
        if problem is not None:
            ready, status, reason = False, "decoder_unavailable", "the vLLM decoder does not answer"
        body = {"ready": ready, "status": status, **({"reason": reason} if reason else {})}
        return JSONResponse(body, status_code=200 if ready else 503, headers=None if ready else {"Retry-After": "5"})
    return await _readiness(svc)


@router.get("/v1/status", response_model=Readiness, responses={503: {"model": Readiness}})
async def status(svc: State) -> JSONResponse:
    """/readyz with every detail (the same body /readyz gives when no API key is set)."""
    return await _readiness(svc)


@router.get("/v1/verify")
async def verify(svc: State, stack: ReadyStack) -> dict:
    """Check every passage's KV and the index against the passage store (no repair); names documents whose
    ingestion did not finish (`incomplete`). Runs on the engine queue."""
    report = await run_job(svc.worker, lambda job: stack.pipeline.verify(repair=False), svc.settings.service.request_timeout_s,
                           "verify")
    return {"ok": report.ok, "passages": report.passages, "kv_ok": report.kv_ok, "problems": list(report.problems),
            "incomplete": list(report.incomplete), "index_missing": report.index_missing,
            "index_extra": report.index_extra}


@router.get("/metrics", response_class=Response)
async def metrics(svc: State) -> Response:
    return Response(await run_in_threadpool(generate_latest, svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)
