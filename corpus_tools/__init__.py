"""Corpus tools: settings shared with the service, ingestion pipeline, the `Stack`, the batch CLI.

Heavy modules load lazily, so `from corpus_tools.settings import Settings` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Document": "corpus_tools.documents",
    "Reader": "corpus_tools.documents",
    "IngestPipeline": "corpus_tools.pipeline",
    "IngestSummary": "corpus_tools.pipeline",
    "Stack": "corpus_tools.stack",
    "build_stack": "corpus_tools.stack",
    "ingest_sample_on_first_start": "corpus_tools.stack",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'corpus_tools' has no attribute {name!r}")
