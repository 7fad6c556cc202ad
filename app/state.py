"""What the routes share: the service state hung on `app.state.svc`, reached through FastAPI
dependencies (`State`, `Svc settings`) rather than by each route reading `request.app.state`."""

from __future__ import annotations

import logging
import threading
from typing import Annotated

from fastapi import Depends, Request

from app.metrics import Metrics
from app.service import NotReady, QueryOutcome
from app.settings import ServiceSettings
from app.worker import EngineWorker
from blendserve_config.stack import Stack
from corpus_tools.jobs import JobRunner

logger = logging.getLogger(__name__)


class AppState:
    """Everything the routes need, hung on `app.state.svc`."""

    def __init__(self, settings: ServiceSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.worker: EngineWorker | None = None
        self.stack: Stack | None = None
        self.jobs: JobRunner | None = None  # background ingestion (uploads, the first-start sample corpus)
        self.ready = False
        self.error: str | None = None
        self.closing = threading.Event()

    def require_stack(self) -> Stack:
        if self.error is not None:
            raise NotReady(f"start-up failed: {self.error}")
        if not self.ready or self.stack is None or self.worker is None:
            raise NotReady("the model, index and KV store are still loading")
        return self.stack

    def require_jobs(self) -> JobRunner:
        self.require_stack()
        if self.jobs is None:
            raise NotReady("the ingestion job runner is starting")
        return self.jobs

    def observe(self, endpoint: str, outcome: QueryOutcome) -> None:
        """A finished query: its metrics and one log line."""
        self.metrics.observe_query(outcome.report, outcome.ttft_ms, outcome.total_ms)
        if outcome.fallback:
            self.metrics.blend_fallbacks.inc()
        self.metrics.requests.labels(endpoint, "200").inc()
        r = outcome.report
        logger.info("%s mode=%s passages=%d hits=%d misses=%d recomputed=%d/%d ttft=%.1fms total=%.1fms", endpoint,
                    r.mode, len(outcome.passages), r.cache_hits, r.cache_misses, r.recomputed_tokens,
                    r.context_tokens, outcome.ttft_ms, outcome.total_ms)


def get_state(request: Request) -> AppState:
    return request.app.state.svc


def get_stack(svc: Annotated[AppState, Depends(get_state)]) -> Stack:
    """The stack, or 503 while it loads. Only for routes with nothing to validate first (a route that
    checks its body must 422 before it 503s, so it calls `require_stack` itself)."""
    return svc.require_stack()


State = Annotated[AppState, Depends(get_state)]
ReadyStack = Annotated[Stack, Depends(get_stack)]
