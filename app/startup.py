"""Start-up work done on a thread started by the lifespan: build the stack, start the ingestion job runner
(resuming unfinished jobs); /readyz turns true then. The fidelity gate starts from that moment: its
prefills are background work of the engine loop, a layer a loop turn (`EngineLoop.run_stepped`; a thread
of its own only waits for them), so requests meanwhile run at their normal speed. Until it has decided,
blend requests are answered by full prefill (under
BLENDSERVE_FIDELITY_GATE=enforce) and /readyz says `blend: checking`. On the first start (no passage
ingested yet) the bundled sample corpus is then ingested as a background job: questions are answered
meanwhile from what is indexed so far, and /readyz reports the job's progress (`ingestion`)."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from blend_engine.executor.kv_pool import KVPool
from blend_engine.model.cpu_threads import use_cores
from blend_engine.selfcheck import GateDecision, decide
from blendserve_config.stack import sample_to_ingest
from corpus_tools.jobs import JobFile, JobRunner

logger = logging.getLogger(__name__)


def run_fidelity_gate(stack, metrics) -> GateDecision:
    """The start-up fidelity gate (BLENDSERVE_ENGINE_FIDELITY_GATE); its numbers go to the log and metrics.

    A probe that cannot be read (sample corpus missing) leaves blend enabled, with the error shown."""
    mode = stack.settings.engine.fidelity_gate
    loop = stack.engine.loop
    try:
        if mode != "off":
            loop.start()  # its prefills run on the loop's thread, never beside it
        decision = decide(mode, stack.runner, stack.engine.config, stack.settings.data_dir, run_stepped=loop.run_stepped)
    except (OSError, ValueError) as exc:
        logger.warning("fidelity gate could not run (%s); blend is served unchecked", exc)
        decision = GateDecision(mode, None, error=f"{type(exc).__name__}: {exc}")
    metrics.set_fidelity(decision)
    return decision


FIRST_BATCH_WAIT_S = 120.0  # the longest the gate waits for a first start's first searchable passages


def _await_first_passages(stack, closing: threading.Event, timeout_s: float = FIRST_BATCH_WAIT_S) -> None:
    """On a first start, let the sample's first batch in before the gate takes its share of the CPU: the
    first answer needs passages, blend can wait (it is served by full prefill meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while stack.pipeline.db.counts()["passages"] == 0 and time.monotonic() < deadline:
        if closing.wait(0.5):
            return


def _gate_in_background(stack, metrics, closing: threading.Event, first_start: bool) -> None:
    """The gate thread's body: decide, publish, then let blend requests through (or not). Never raises."""
    if first_start:
        _await_first_passages(stack, closing)
    if closing.is_set():
        return
    t0 = time.perf_counter()
    try:
        decision = run_fidelity_gate(stack, metrics)
    except Exception as exc:  # noqa: BLE001 - an unexpected failure leaves blend unchecked, named in /readyz
        logger.exception("fidelity gate failed")
        decision = GateDecision(stack.settings.engine.fidelity_gate, None, error=f"{type(exc).__name__}: {exc}")
    stack.gate = decision
    stack.gate_checking = False
    logger.info("fidelity gate decided in %.1f s: blend %s", time.perf_counter() - t0,
                "off (full prefill)" if decision.fallback else "on")


def start_fidelity_gate(stack, metrics, closing: threading.Event | None = None,
                        first_start: bool = False) -> threading.Thread | None:
    """Run the gate on a thread of its own (None when it is off); blend is `checking` until it decides.
    `first_start` (the sample corpus is being ingested): it starts once the first passages are searchable."""
    if stack.settings.engine.fidelity_gate == "off":
        stack.gate = run_fidelity_gate(stack, metrics)  # off: decided at once, nothing measured
        return None
    stack.gate_checking = True
    thread = threading.Thread(target=_gate_in_background, name="blendserve-gate", daemon=True,
                              args=(stack, metrics, closing or threading.Event(), first_start))
    thread.start()
    return thread


def _serving(stack) -> bool:
    """The engine has requests running or waiting (background ingestion yields to them)."""
    stats = stack.engine.loop.stats()
    return stats["running"] + stats["waiting"] > 0


def submit_sample(stack, runner: JobRunner) -> str | None:
    """First start (nothing stored, no sample job on record): the sample corpus as a background job. Its id."""
    path = sample_to_ingest(stack)
    if path is None or runner.store.latest("sample") is not None:
        return None
    job = runner.submit("sample", [JobFile(path.name, str(path), path.stat().st_size)])
    logger.info("first start: ingesting the sample corpus %s in the background (job %s)", path, job.id)
    return job.id


def freeze_startup_objects() -> int:
    """Move every object alive now (start-up's: the model's modules, the tokenizer, the index's maps;
    ~480K for the default model) out of the garbage collector's reach, once, before the first request:
    a full collection holds the GIL while it walks them (163-181 ms on the start-up thread here), and
    one while serving would stall every stream and the engine loop's Python for as long. Later
    collections walk only what serving makes. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%d start-up objects frozen out of garbage collection", frozen)
    return frozen


def prefault_pool(pool: KVPool) -> None:
    """Write the KV pool's pages once before the engine loop starts (BLENDSERVE_ENGINE_KV_POOL_PREFAULT)."""
    t0 = time.perf_counter()
    written = pool.prefault()
    if written:
        logger.info("KV pool: %d MiB written once in %.1f s (resident from now on)", written >> 20,
                    time.perf_counter() - t0)


def build_and_warm(svc, factory: Callable[[Any], Any]) -> None:
    """Runs on the start-up thread. Never raises: failures are logged and shown by /readyz."""
    settings = svc.settings
    t0 = time.perf_counter()
    use_cores()  # a short-lived thread: its OpenMP team goes with it (`cpu_threads`)
    try:
        logger.info("loading model %s, index and KV store (data dir %s)", settings.model.name, settings.data_dir)
        stack = factory(settings)
        if svc.closing.is_set():
            stack.close()
            return
        stack.gate_checking = settings.engine.fidelity_gate != "off"  # blend: full prefill until the gate decides
        if settings.engine.kv_pool_prefault:
            prefault_pool(stack.engine.loop.pool)
        stack.engine.loop.start()  # ingestion's precompute runs there too, on every core (`cpu_threads`)
        if svc.host_work is not None:  # storing and the gate's prefills make way for queries' host work
            svc.host_work.yields_to(stack.engine.loop.background)
        svc.stack = stack
        stack.start_sync()  # follow other replicas' (and the CLI's) ingestions from now on
        jobs = JobRunner(stack.pipeline, settings.data_dir, svc.closing.is_set, busy=lambda: _serving(stack))
        svc.jobs = jobs  # the lifespan closes it from here on
        jobs.start()  # jobs a previous process left unfinished resume (the thread ends at once when closing)
        if svc.closing.is_set():
            return
        freeze_startup_objects()
        svc.ready = True  # answers from now on, from what is indexed so far
        logger.info("ready in %.1f s", time.perf_counter() - t0)
        sample = submit_sample(stack, svc.jobs)
        start_fidelity_gate(stack, svc.metrics, svc.closing, first_start=sample is not None)
    except Exception as exc:  # noqa: BLE001 - reported by /readyz, the process stays up for /healthz
        svc.error = f"{type(exc).__name__}: {exc}"
        logger.exception("start-up failed")
