"""Keep a replica's in-memory FAISS index in step with the shared passage store's change log.

At start the index is reconciled with the store (`retriever.open_index`) and its generation set
to the store's head read *before* reconciling; from then on `IndexSync` reads the change log
whenever the store announces a write (PostgreSQL LISTEN/NOTIFY) and at least every `interval_s`
(the only trigger on SQLite, and the fallback when notifications are lost), and applies additions
and deletions in log order. Applying is idempotent (an
add of a vector already present, or a delete of one absent, changes nothing), so changes made by
this replica itself, already in its index, and changes racing the start-up reconcile are harmless.

The generation is the sequence number of the last change applied; the lag is how far the store's
head is ahead (in changes) and how old the oldest unapplied change is (in seconds, store clock).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from retrieval.embedder import Embedder
from retrieval.index import VectorIndex
from retrieval.passages import Change, PassageStore
from retrieval.vectors import stored_or_embedded

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncStatus:
    generation: int  # last change-log sequence number applied to this replica's index
    head: int  # the store's newest change-log sequence number at the last poll
    lag_changes: int
    lag_s: float  # age of the oldest unapplied change at the last poll (0 when caught up)
    applied: int  # changes applied since start
    last_poll_at: float  # wall clock of the last successful poll (0 before the first)
    error: str | None = None  # the last poll's failure, if it failed

    def as_dict(self) -> dict:
        return asdict(self)


class IndexSync:
    """Applies the change log to `index`. `step()` once by hand, or `start()` a polling thread."""

    def __init__(self, index: VectorIndex, store: PassageStore, embedder: Embedder, generation: int,
                 interval_s: float = 0.5, batch: int = 1000, start_info: dict | None = None) -> None:
        self.index = index
        self.start_info = dict(start_info or {})  # how the index was opened: loaded, caught_up, added, removed
        self.store = store
        self.embedder = embedder
        self.interval_s = interval_s
        self.batch = batch
        self._generation = generation
        self._head = generation
        self._lag_s = 0.0
        self._applied = 0
        self._last_poll = 0.0
        self._error: str | None = None
        self._lock = threading.Lock()  # one step at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ applying
    def step(self) -> int:
        """Apply every change after the current generation. Returns the number applied."""
        with self._lock:
            total = 0
            while True:
                head = self.store.head()
                changes = self.store.changes_since(self._generation, self.batch)
                self._head = max(head.seq, changes[-1].seq if changes else 0)
                self._lag_s = max(0.0, head.now - changes[0].at) if changes else 0.0
                if not changes:
                    break
                self._apply(changes)
                self._generation = changes[-1].seq
                self.index.generation = self._generation  # saved with the index: a restart resumes here
                total += len(changes)
                if len(changes) < self.batch:
                    break
            self._applied += total
            self._last_poll = time.time()
            self._error = None
            if self._generation >= self._head:
                self._lag_s = 0.0
            return total

    def poll(self) -> SyncStatus:
        """Read the store's head and measure the lag without applying anything."""
        with self._lock:
            head = self.store.head()
            changes = self.store.changes_since(self._generation, 1)
            self._head = max(head.seq, self._generation)
            self._lag_s = max(0.0, head.now - changes[0].at) if changes else 0.0
        return self.status()

    def _apply(self, changes: list[Change]) -> None:
        """Apply in log order (runs of the same op together); vectors of added passages come from
        the store (embedded here where a row has none); an add whose row is gone is skipped (its
        `del` is in the log after it)."""
        wanted = [c.vec_id for c in changes if c.op == "add" and c.vec_id not in self.index]
        vectors = stored_or_embedded(self.store, self.embedder, wanted) if wanted else {}
        added = removed = 0
        for op, run in _runs(changes):
            ids = list(dict.fromkeys(c.vec_id for c in run))
            if op == "del":
                removed += self.index.remove(np.asarray(ids, dtype=np.int64))
                continue
            ids = [i for i in ids if i in vectors and i not in self.index]
            if ids:
                added += self.index.add(np.asarray(ids, dtype=np.int64), np.stack([vectors[i] for i in ids]))
        if added or removed:
            logger.info("index sync: +%d -%d (generation %d)", added, removed, changes[-1].seq)

    # ------------------------------------------------------------------ the polling thread
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="blendserve-index-sync", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wait()
            if self._stop.is_set():
                return
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - the store may be down for a while: keep polling
                if self._error is None:
                    logger.warning("index sync failed (will retry every %.1f s): %s", self.interval_s, exc)
                self._error = f"{type(exc).__name__}: {exc}"

    def _wait(self) -> None:
        """Until the store announces a write (PostgreSQL NOTIFY) or `interval_s` passes; waits in
        slices of at most 1 s so `stop()` is prompt."""
        deadline = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                woken = self.store.wait_for_change(min(left, 1.0))
            except Exception:  # noqa: BLE001 - waiting is best effort; the poll after it decides
                woken = None
            if woken is None:  # no notifications (SQLite) or they failed: plain polling
                self._stop.wait(left)
                return
            if woken:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    @property
    def generation(self) -> int:
        return self._generation

    def status(self) -> SyncStatus:
        lag_changes = max(0, self._head - self._generation)
        lag_s = self._lag_s
        if self._error is not None and self._last_poll:
            lag_s = max(lag_s, time.time() - self._last_poll)  # unknown while the store is unreachable
        return SyncStatus(self._generation, self._head, lag_changes, round(lag_s, 3), self._applied,
                          self._last_poll, self._error)


def _runs(changes: list[Change]) -> list[tuple[str, list[Change]]]:
    """Consecutive changes grouped by op, order kept: [add a, add b, del a] -> [(add, [a, b]), (del, [a])]."""
    runs: list[tuple[str, list[Change]]] = []
    for c in changes:
        if runs and runs[-1][0] == c.op:
            runs[-1][1].append(c)
        else:
            runs.append((c.op, [c]))
    return runs
