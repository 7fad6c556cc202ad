"""Start-up work done on a thread started by the lifespan: build the stack and, on the first start
(no passage ingested yet), ingest the bundled sample corpus. /readyz turns true afterwards."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SAMPLE_BATCH = 10


def _is_empty(stack) -> bool:
    """First start: nothing ingested yet (an empty data dir, or a first start cut short)."""
    return int(stack.pipeline.stats().get("passages", 0)) == 0


def ingest_sample(pipeline, path: Path, should_stop: Callable[[], bool]) -> int:
    """Ingest the sample corpus in batches, logging progress. Returns the documents ingested."""
    from corpus_tools.documents import Reader

    docs = list(Reader().read([path]))
    total, done, t0 = len(docs), 0, time.perf_counter()
    logger.info("first start: ingesting %d sample documents from %s", total, path)
    for start in range(0, total, SAMPLE_BATCH):
        if should_stop():
            logger.info("sample ingestion interrupted by shutdown at %d/%d", done, total)
            break
        summary = pipeline.ingest(docs[start:start + SAMPLE_BATCH], progress=False)
        done += len(docs[start:start + SAMPLE_BATCH])
        for err in getattr(summary, "errors", None) or []:
            logger.warning("sample ingestion: %s", err)
        logger.info("sample ingestion %d/%d documents (%.1f s)", done, total, time.perf_counter() - t0)
    return done


def build_and_warm(svc, factory: Callable[[Any], Any]) -> None:
    """Runs on the start-up thread. Never raises: failures are logged and shown by /readyz."""
    settings = svc.settings
    t0 = time.perf_counter()
    try:
        logger.info("loading model %s, index and KV store (data dir %s)", settings.model, settings.data_dir)
        stack = factory(settings)
        if svc.closing.is_set():
            stack.close()
            return
        svc.stack = stack
        stack.start_sync()  # follow other replicas' (and the CLI's) ingestions from now on
        sample = settings.sample_corpus
        if settings.ingest_sample_on_start and sample is not None and _is_empty(stack):
            if Path(sample).is_file():
                ingest_sample(stack.pipeline, Path(sample), svc.closing.is_set)
            else:
                logger.warning("sample corpus %s not found; starting with an empty index", sample)
        if svc.closing.is_set():
            return
        svc.ready = True
        logger.info("ready in %.1f s", time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - reported by /readyz, the process stays up for /healthz
        svc.error = f"{type(exc).__name__}: {exc}"
        logger.exception("start-up failed")
