"""What ingestion and maintenance share: the engine and its KV store, the embedder, the vector
index, the passage store (the source of truth) and one lock that serializes every write.

KV byte counts come from the codec (`codec.layer_nbytes`), so the ingest summary, `stats()` and
`/readyz` report what the store actually holds per token (int8 includes its fp16 scales).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

from blend_engine.cancel import StopCheck, never
from blend_engine.engine import BlendEngine
from blend_engine.kv_store.codec import layer_nbytes
from blend_engine.layout import PRECOMPUTED_MARKERS, marker_text
from blend_engine.types import BlendPlan
from retrieval.embedder import Embedder
from retrieval.index import VectorIndex
from retrieval.passages import PassageStore
from retrieval.text import format_passage


class Corpus:
    """The parts of one corpus. Thread-safe writes: callers hold `lock` around them."""

    def __init__(self, engine: BlendEngine, embedder: Embedder, index: VectorIndex, db: PassageStore,
                 index_dir: Path) -> None:
        self.engine = engine
        self.embedder = embedder
        self.index = index
        self.db = db
        self.index_dir = Path(index_dir)
        self.lock = threading.RLock()

    @property
    def store(self):
        return self.engine.store

    def kv_nbytes(self, n_tokens: int) -> int:
        """Stored KV bytes of a chunk of `n_tokens` in the engine's format (every layer, k and v)."""
        s = self.engine.runner.shape
        return s.n_layers * layer_nbytes(self.engine.config.kv_format, s.n_kv_heads, n_tokens, s.head_dim)

    def kv_bytes_per_token(self) -> int:
        """Stored bytes each further token adds to a chunk (int8's per-chunk K scales not included)."""
        return self.kv_nbytes(1) - self.kv_nbytes(0)

    def kv_estimate(self, passages: int, tokens: int) -> int:
        """Stored KV bytes of `passages` chunks holding `tokens` tokens in all. Exact: a chunk's size is
        affine in its tokens (per-token values and scales, plus int8's per-chunk K scales)."""
        return tokens * self.kv_bytes_per_token() + passages * self.kv_nbytes(0)

    def passage_tokens(self, text: str, title: str) -> list[int]:
        """Token ids of a passage exactly as the engine caches it."""
        return self.engine.passage_tokens(format_passage(text, title))

    def system_key(self) -> tuple[str, list[int]]:
        """Key and ids of the default system prefix (cached alone at position 0, like a passage)."""
        sys_seg = self.engine.layout(BlendPlan(passages=("x",), question="x")).segments[0]
        return self.engine.key_of(sys_seg.token_ids), list(sys_seg.token_ids)

    def fixed_chunks(self) -> list[tuple[str, list[int]]]:
        """Keys and ids of the chunks prompts share whatever they ask: the default system prefix and
        the markers `[1]` .. `[PRECOMPUTED_MARKERS]` that number passages (`layout.marker_text`)."""
        markers = [self.engine.runner.encode(marker_text(n)) for n in range(1, PRECOMPUTED_MARKERS + 1)]
        return [self.system_key()] + [(self.engine.key_of(ids), ids) for ids in markers]

    def cache(self, token_ids: list[int], should_stop: StopCheck = never) -> tuple[str, bool]:
        """Make sure the KV of these passage tokens is stored: (key, was already cached). Raises
        `Cancelled` before or between the layers of its precompute once `should_stop()` is true."""
        return self.engine.cache_ids(token_ids, should_stop=should_stop)

    def drop_unused_kv(self, keys: Iterable[str]) -> None:
        """Delete the KV entries no passage references any more. Caller holds the lock."""
        for key in keys:
            if not self.db.key_in_use(key):
                self.store.delete(key)

    def save_index(self) -> None:
        self.index.save(self.index_dir)
