"""Corpus maintenance: documents (get, delete), verify and repair, and KV garbage collection.

The passage store is the truth: verify checks every visible passage's KV (present, right key,
right shape, finite) and the vector index against it, names documents whose ingestion did not
finish, and with `repair` recomputes bad KV, drops unfinished documents and reconciles the index.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from blend_engine.kv_store.base import KVStore
from corpus_tools.corpus import Corpus
from logsafe import printable
from retrieval.passages import PassageRow
from retrieval.retriever import reconcile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyReport:
    passages: int
    kv_ok: int
    problems: tuple[str, ...]
    repaired: int
    index_missing: int
    index_extra: int
    incomplete: tuple[str, ...] = ()  # documents whose ingestion did not finish (staged, not visible)

    @property
    def ok(self) -> bool:
        return not self.problems or self.repaired >= len(self.problems)


class Maintenance:
    """Reads and maintenance writes over a `Corpus`; writes hold the corpus lock."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus

    # ------------------------------------------------------------------ documents
    def get_document(self, doc_id: str) -> dict | None:
        rows = self.corpus.db.document(doc_id)
        if not rows:
            return None
        return {
            "doc_id": doc_id, "title": rows[0].title, "source": rows[0].source,
            "passages": [{"id": r.id, "title": r.title, "text": r.text, "token_count": r.token_count,
                          "kv_key": r.kv_key, "location": r.location} for r in rows],
        }

    def delete_document(self, doc_id: str) -> bool:
        """Remove the document's passages (passage store, then index, then KV entries no one else uses)."""
        c = self.corpus
        with c.lock:
            rows = c.db.delete_document(doc_id)
            if not rows:
                return False
            c.index.remove(np.asarray([r.vec_id for r in rows], dtype=np.int64))
            c.save_index()
            c.drop_unused_kv({r.kv_key for r in rows})
            logger.info("deleted document %s (%d passages)", doc_id, len(rows))
            return True

    # ------------------------------------------------------------------ verify and repair
    def verify(self, repair: bool = False, progress: bool = False) -> VerifyReport:
        """Check every passage's KV (present, right key, right shape) and the index against the passage store."""
        c = self.corpus
        with c.lock:
            rows = c.db.all_rows()
            problems: list[str] = []
            repaired = kv_ok = 0
            for row in tqdm(rows, desc="verify", unit="passage", file=sys.stderr, disable=not progress):
                problem = self._check_row(row)
                if problem is None:
                    kv_ok += 1
                    continue
                problems.append(f"passage {row.id} (doc {row.doc_id}): {problem}")
                if repair:
                    self._repair_row(row)
                    repaired += 1
            incomplete = c.db.incomplete()
            repaired += self._check_incomplete(incomplete, problems, repair)
            missing, extra, fixed = self._check_index(problems, repair)
            return VerifyReport(len(rows), kv_ok, tuple(problems), repaired + fixed, missing, extra, tuple(incomplete))

    def _check_incomplete(self, incomplete: dict[str, int], problems: list[str], repair: bool) -> int:
        """Name documents left staged by an unfinished ingestion; with repair drop them. Returns the repaired count."""
        for doc_id, n in incomplete.items():
            problems.append(f"document {printable(doc_id)}: incomplete ingestion ({n} passages staged, not visible); "
                            "re-run its ingestion to complete it" + ("; dropped" if repair else ""))
        if repair and incomplete:
            self.corpus.db.discard(list(incomplete))
            return len(incomplete)
        return 0

    def _check_index(self, problems: list[str], repair: bool) -> tuple[int, int, int]:
        """(vectors missing, vectors without a passage, repaired 0/1) of the index against the passage store."""
        c = self.corpus
        want, have = c.db.vec_ids(), set(c.index.ids().tolist())
        missing, extra = len(want - have), len(have - want)
        if not (missing or extra):
            return missing, extra, 0
        problems.append(f"index: {missing} passages missing, {extra} vectors without a passage")
        if not repair:
            return missing, extra, 0
        reconcile(c.index, c.db, c.embedder)
        c.save_index()
        return missing, extra, 1

    def _check_row(self, row: PassageRow) -> str | None:
        c = self.corpus
        ids = c.passage_tokens(row.text, row.title)
        key = c.engine.key_of(ids)
        if key != row.kv_key:
            return f"stored KV key {row.kv_key} is stale (model or tokenizer changed; now {key})"
        if len(ids) != row.token_count:
            return f"token count {row.token_count} != {len(ids)}"
        kv = c.store.get(key)
        if kv is None:
            return "KV cache missing or unreadable"
        n_layers = c.engine.runner.shape.n_layers
        if kv.n_tokens != len(ids) or kv.n_layers != n_layers:
            return f"KV cache has shape layers={kv.n_layers} tokens={kv.n_tokens}, want {n_layers}, {len(ids)}"
        if not bool(kv.k.isfinite().all()) or not bool(kv.v.isfinite().all()):
            return "KV cache holds non-finite values"
        return None

    def _repair_row(self, row: PassageRow) -> None:
        """Recompute the passage's KV from its text; a changed key or token count is written to its row."""
        c = self.corpus
        ids = c.passage_tokens(row.text, row.title)
        c.store.delete(c.engine.key_of(ids))
        key, _ = c.cache(ids)
        if key != row.kv_key or len(ids) != row.token_count:
            c.db.set_kv(row.id, key, len(ids))
            c.drop_unused_kv([row.kv_key])

    # ------------------------------------------------------------------ gc
    def gc(self) -> dict:
        """Drop KV entries that no passage (nor the system prefix, nor a passage marker) references, where
        tiers can list keys. A conversation's turns are dropped too: a later turn recomputes them."""
        c = self.corpus
        with c.lock:
            keep = c.db.kv_keys() | {key for key, _ in c.fixed_chunks()}
            listed, unlisted = _listed_keys(c.store)
            if not listed:
                return {"supported": False, "referenced": len(keep), "dropped": 0, "unlisted_tiers": unlisted,
                        "message": f"store {c.store.name!r} cannot list its keys; nothing dropped"}
            before = c.store.stats().bytes_used
            candidates = {k for keys in listed.values() for k in keys} - keep
            dropped = sum(1 for key in sorted(candidates) if c.store.delete(key))
            freed = before - c.store.stats().bytes_used
            return {"supported": True, "referenced": len(keep), "dropped": dropped, "freed_bytes": freed,
                    "tiers": list(listed), "unlisted_tiers": unlisted}


def _listed_keys(store: KVStore) -> tuple[dict[str, list[str]], list[str]]:
    """({tier name: its keys} for the tiers that can list them, names of those that cannot)."""
    listed, unlisted = {}, []
    for tier in store.tiers:
        keys = tier.keys()
        if keys is None:
            unlisted.append(tier.name)
        else:
            listed[tier.name] = keys
    return listed, unlisted
