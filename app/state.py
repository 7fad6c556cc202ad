"""What the routes share: the service state hung on `app.state.svc`, reached through FastAPI
dependencies (`State`, `Svc settings`) rather than by each route reading `request.app.state`."""

from __future__ import annotations

import logging
import threading
import time
from typing import Annotated

from fastapi import Depends, Request

from app.host_work import HostWork
from app.metrics import Metrics
from app.service import NotReady, QueryOutcome
from app.settings import ServiceSettings
from app.vllm_decoder import VllmClient
from app.worker import EngineWorker
from blend_engine.client import EngineClient
from blendserve_config.stack import Stack
from blendserve_vllm.segments import RedisPublisher, SegmentPublisher
from corpus_tools.jobs import JobRunner

logger = logging.getLogger(__name__)


class AppState:
    """Everything the routes need, hung on `app.state.svc`."""

    def __init__(self, settings: ServiceSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.worker: EngineWorker | None = None  # blocking jobs (document ingestion, verify); queries use `client`
        self.host_work: HostWork | None = None  # queries' retrieval and planning (low-priority threads)
        self.stack: Stack | None = None
        self.client: EngineClient | VllmClient | None = None  # set with the stack: the routes' way to the engine
        self.jobs: JobRunner | None = None  # background ingestion (uploads, the first-start sample corpus)
        self.ready = False
        self.error: str | None = None
        self.closing = threading.Event()
        self._ingest_clock: tuple[str, float, int] | None = None  # (sample job, when first seen, documents done)

    def require_stack(self) -> Stack:
        if self.error is not None:
            raise NotReady(f"start-up failed: {self.error}")
        if not self.ready or self.stack is None or self.worker is None or self.host_work is None:
            raise NotReady("the model, index and KV store are still loading")
        return self.stack

    def require_client(self) -> EngineClient | VllmClient:
        """The engine client the routes submit to: the engine's own, or with BLENDSERVE_DECODER_KIND=vllm
        the one that blends here and decodes on vLLM (`app.vllm_decoder`)."""
        stack = self.require_stack()
        if self.client is None or self.client.engine is not stack.engine:
            self.client = EngineClient(stack.engine)
            if self.settings.decoder.kind == "vllm":
                self.client = self._vllm_client(stack)
        return self.client

    def _vllm_client(self, stack: Stack) -> VllmClient:
        d = self.settings.decoder
        if d.handover == "redis":
            url = d.handover_redis_url or self.settings.store.redis_url
            if not url:
                raise NotReady("BLENDSERVE_DECODER_HANDOVER=redis needs BLENDSERVE_DECODER_HANDOVER_REDIS_URL "
                               "(or BLENDSERVE_STORE_REDIS_URL)")
            publisher = RedisPublisher(url, d.handover_mb << 20, d.handover_ttl_s)
        else:
            publisher = SegmentPublisher(d.segment_dir, d.handover_mb << 20, d.handover_ttl_s)
        return VllmClient(EngineClient(stack.engine), d, publisher, stack.engine.runner.decode)

    async def decoder_problem(self) -> str | None:
        """Why the decoder cannot serve now (None: the own engine, or a vLLM server that answers)."""
        if self.settings.decoder.kind != "vllm" or self.stack is None:
            return None
        client = self.require_client()
        return await client.problem() if isinstance(client, VllmClient) else None

    async def close_client(self) -> None:
        client, self.client = self.client, None
        if isinstance(client, VllmClient):
            client.publisher.close()
            await client.aclose()

    def require_jobs(self) -> JobRunner:
        self.require_stack()
        if self.jobs is None:
            raise NotReady("the ingestion job runner is starting")
        return self.jobs

    def ingestion(self) -> dict | None:
        """The first-start sample job's progress: status, documents done / total, passages searchable, and
        an ETA from this process's rate (None until measurable); None when there is no sample job."""
        runner = self.jobs
        job_id = runner.store.latest("sample") if runner is not None else None
        job = runner.get(job_id) if job_id else None
        if job is None:
            return None
        info = job.as_dict()
        done, total = info["processed"], info["documents"]
        stack = self.stack
        passages = stack.pipeline.db.counts()["passages"] if stack is not None else None
        return {"job_id": job.id, "status": job.status, "documents": total, "processed": done,
                "passages": passages, "eta_s": self._eta(job.id, job.status, done, total), "error": job.error}

    def _eta(self, job_id: str, status: str, done: int, total: int) -> float | None:
        """Seconds left at the rate measured since this process first saw the job running."""
        if status != "running" or total <= 0:
            return 0.0 if status == "done" else None
        now = time.monotonic()
        if self._ingest_clock is None or self._ingest_clock[0] != job_id:
            self._ingest_clock = (job_id, now, done)
            return None
        _, since, start = self._ingest_clock
        if done <= start or now <= since:
            return None
        return round((total - done) * (now - since) / (done - start), 1)

    def blend(self) -> dict | None:
        """Whether blend is served: `checking` while the start-up fidelity gate runs, then `on` or `off`,
        with the reason; None before the stack is built."""
        stack = self.stack
        if stack is None:
            return None
        if getattr(stack, "gate_checking", False):
            enforced = stack.settings.engine.fidelity_gate == "enforce"
            return {"state": "checking", "reason": "the start-up fidelity gate is running; blend requests are "
                    + ("answered by full prefill until it passes" if enforced else "served meanwhile (warn)")}
        gate = getattr(stack, "gate", None)
        if gate is None or gate.mode == "off":
            return {"state": "on", "reason": "fidelity gate off (BLENDSERVE_FIDELITY_GATE=off)"}
        if gate.fallback:
            return {"state": "off", "reason": gate.reason}
        if gate.error is not None:
            return {"state": "on", "reason": f"the fidelity gate could not run ({gate.error}); served unchecked"}
        if gate.result is None:
            return {"state": "on", "reason": "the fidelity gate gave no result; served unchecked"}
        if not gate.result.passed:
            return {"state": "on", "reason": "blend failed the fidelity gate; served anyway (warn)"}
        return {"state": "on", "reason": "blend passed the fidelity gate" + (" (cached)" if gate.result.cached else "")}

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
