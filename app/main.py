"""The HTTP service: `create_app`, the factory that wires state, routes, errors and middleware.

`create_app(settings, stack_factory)` returns a FastAPI app. Heavy objects (model, index, KV
store) are built by `stack_factory` on a start-up thread once the lifespan begins; until then
/healthz answers and /readyz says 503. A query awaits the engine client on the event loop (the
engine loop thread does the model work; admission is the engine's, `blend_engine.scheduler.admission`);
blocking jobs (document ingestion, verify) run on `EngineWorker` threads behind a bounded queue.

Where things are: the routes by area in `app/routes/`, the shared state and its dependencies in
`app/state.py`, the error envelope and handlers in `app/errors.py`, server-sent events in
`app/streaming.py`, the request logic (no HTTP models in or out: a `QuerySpec` in, a `QueryOutcome`
out) in `app/service.py`, and the response bodies built from its results in `app/presenters.py`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

import logsafe
from app.auth import BearerAuthMiddleware, Keyring
from app.errors import install_handlers
from app.host_work import HostWork
from app.limits import BodySizeLimitMiddleware
from app.metrics import Metrics
from app.routes import ROUTERS
from app.routes.jobs import UPLOAD_PATH
from app.routes.page import STATIC_DIR
from app.settings import ServiceSettings
from app.startup import build_and_warm
from app.state import AppState
from app.timing import ArrivalMiddleware
from app.worker import EngineWorker
from blendserve_config.stack import Stack, build_stack

__all__ = ["STATIC_DIR", "AppState", "StackFactory", "create_app"]

logger = logging.getLogger(__name__)

StackFactory = Callable[[ServiceSettings], Stack]


def _lifespan(settings: ServiceSettings, factory: StackFactory):
    """Start the workers and the start-up thread; on the way out stop both and close the stack."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc: AppState = app.state.svc
        svc.worker = EngineWorker(settings.request_threads, settings.service.max_queue)
        svc.host_work = HostWork(settings.service.query_threads, settings.service.query_nice,
                                 settings.service.query_idle)
        starter = threading.Thread(target=build_and_warm, args=(svc, factory), name="blendserve-startup", daemon=True)
        starter.start()
        try:
            yield
        finally:
            svc.closing.set()
            svc.ready = False
            await svc.close_client()  # the vLLM decoder's segments and connections
            await run_in_threadpool(svc.worker.close)
            svc.host_work.close()
            if svc.jobs is not None:  # the current file stops at its next checkpoint; the job resumes next start
                await run_in_threadpool(svc.jobs.close)
            stack, svc.stack = svc.stack, None
            if stack is not None:
                await run_in_threadpool(stack.close)
            logger.info("shut down")

    return lifespan


def create_app(settings: ServiceSettings | None = None, stack_factory: StackFactory | None = None) -> FastAPI:
    settings = settings if settings is not None else ServiceSettings()
    if not isinstance(settings, ServiceSettings):  # a plain Settings would have lost the service's fields
        raise TypeError(f"create_app needs app.settings.ServiceSettings, not {type(settings).__name__}: the service's "
                        "own fields (host, port, api_key, max_queue, limits, ...) live there; a plain Settings "
                        "silently ignores them")
    logsafe.install()
    app = FastAPI(
        title="Blendserve",
        version="0.1.0",
        summary="RAG question answering that reuses each passage's KV cache wherever it lands (CacheBlend).",
        lifespan=_lifespan(settings, stack_factory or build_stack),
    )
    svc = AppState(settings, Metrics())
    app.state.svc = svc
    svc.metrics.bind_store(lambda: svc.stack.store if svc.stack is not None else None)
    svc.metrics.bind_sync(lambda: getattr(svc.stack, "sync", None))
    svc.metrics.bind_batch(lambda: svc.stack.engine.loop if svc.stack is not None else None)
    install_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    # added innermost first: auth, the size limit, then the arrival stamp (all pure ASGI, streaming untouched)
    app.add_middleware(BearerAuthMiddleware, keyring=Keyring(settings.auth.api_key, settings.auth.tenant_keys))
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.limits.max_body_bytes,
                       per_path={UPLOAD_PATH: settings.limits.max_upload_body_bytes})
    app.add_middleware(ArrivalMiddleware)  # outermost: timings count from here (`app.timing`)
    return app
