"""Corpus tools: document readers, chunking and the ingestion pipeline (a library: it imports no settings).

Settings and the `Stack` live in `blendserve_config`, above it; the batch CLI in `corpus_cli`, above that.
Heavy modules load lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Document": "corpus_tools.documents",
    "Reader": "corpus_tools.documents",
    "IngestPipeline": "corpus_tools.pipeline",
    "IngestSummary": "corpus_tools.ingest",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'corpus_tools' has no attribute {name!r}")
