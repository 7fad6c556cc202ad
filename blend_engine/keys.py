"""Content keys for cached chunks: hash(model fingerprint, stored format, token ids).

Keys never depend on position: the same passage has the same key wherever it lands.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from blend_engine.model.runner import KV_LAYOUT_VERSION

# a format whose byte layout changed gets a new tag, so entries in the old layout are never found
_FORMAT_TAGS = {"int8": "int8kc"}  # int8 with K scaled per channel (was: per token)


def store_fingerprint(model_fingerprint: str, kv_format: str) -> str:
    """What a cache entry must match to be usable: weights, stored KV format, layout version."""
    return f"{model_fingerprint}:{_FORMAT_TAGS.get(kv_format, kv_format)}:v{KV_LAYOUT_VERSION}"


def chunk_key(fingerprint: str, token_ids: Sequence[int]) -> str:
    h = hashlib.sha256(fingerprint.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.hexdigest()[:40]


def chain_key(parent: str | None, key: str) -> str:
    """Key of a chunk *in context*: the chunk after the exact prefix `parent` (prefix caching)."""
    return hashlib.sha256(f"{parent or 'root'}>{key}".encode()).hexdigest()[:40]
