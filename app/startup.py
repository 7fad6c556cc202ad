"""Start-up work done on a thread started by the lifespan: build the stack, run the fidelity gate, start
the ingestion job runner (resuming unfinished jobs); /readyz turns true then. On the first start (no
passage ingested yet) the bundled sample corpus is then ingested as a background job: questions are
answered meanwhile from what is indexed so far, and /readyz reports the job's progress (`ingestion`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from blend_engine.selfcheck import GateDecision, decide
from blendserve_config.stack import sample_to_ingest
from corpus_tools.jobs import JobFile, JobRunner

logger = logging.getLogger(__name__)


def run_fidelity_gate(stack, metrics) -> GateDecision:
    """The start-up fidelity gate (BLENDSERVE_ENGINE_FIDELITY_GATE); its numbers go to the log and metrics.

    A probe that cannot be read (sample corpus missing) leaves blend enabled, with the error shown."""
    mode = stack.settings.engine.fidelity_gate
    try:
        decision = decide(mode, stack.runner, stack.engine.config, stack.settings.data_dir)
    except (OSError, ValueError) as exc:
        logger.warning("fidelity gate could not run (%s); blend is served unchecked", exc)
        decision = GateDecision(mode, None, error=f"{type(exc).__name__}: {exc}")
    metrics.set_fidelity(decision)
    return decision


def submit_sample(stack, runner: JobRunner) -> str | None:
    """First start (nothing stored, no sample job on record): the sample corpus as a background job. Its id."""
    path = sample_to_ingest(stack)
    if path is None or runner.store.latest("sample") is not None:
        return None
    job = runner.submit("sample", [JobFile(path.name, str(path), path.stat().st_size)])
    logger.info("first start: ingesting the sample corpus %s in the background (job %s)", path, job.id)
    return job.id


def build_and_warm(svc, factory: Callable[[Any], Any]) -> None:
    """Runs on the start-up thread. Never raises: failures are logged and shown by /readyz."""
    settings = svc.settings
    t0 = time.perf_counter()
    try:
        logger.info("loading model %s, index and KV store (data dir %s)", settings.model.name, settings.data_dir)
        stack = factory(settings)
        if svc.closing.is_set():
            stack.close()
            return
        svc.stack = stack
        stack.gate = run_fidelity_gate(stack, svc.metrics)  # before ready: blend may fall back
        if svc.closing.is_set():
            return
        stack.start_sync()  # follow other replicas' (and the CLI's) ingestions from now on
        jobs = JobRunner(stack.pipeline, settings.data_dir, svc.closing.is_set)
        svc.jobs = jobs  # the lifespan closes it from here on
        jobs.start()  # jobs a previous process left unfinished resume (the thread ends at once when closing)
        if svc.closing.is_set():
            return
        svc.ready = True  # answers from now on, from what is indexed so far
        logger.info("ready in %.1f s", time.perf_counter() - t0)
        submit_sample(stack, svc.jobs)
    except Exception as exc:  # noqa: BLE001 - reported by /readyz, the process stays up for /healthz
        svc.error = f"{type(exc).__name__}: {exc}"
        logger.exception("start-up failed")
