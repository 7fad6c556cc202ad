"""Background ingestion jobs: files ingested one by one on a thread of their own, with per-file progress,
cancellation, and records that survive a restart.

A job is a list of files on disk (uploads saved under the data dir, or the bundled sample corpus). Its
record and each file's progress live in `jobs.sqlite3` in the data dir (`JobStore`); the uploaded files
stay until the job ends. Per file: `queued` -> `parsing` -> `ingesting` (documents read so far of the
file's documents; each batch is published as it completes) -> `done` (passages, new passages, KV
entries computed and stored), or `failed` with its reason, or `cancelled`. A job is `queued`, `running`,
`done` (every file ingested or failed: `failed` counts the failures), `cancelled` or `failed` (nothing
ingested). After a restart, jobs that were queued or running are resumed: their files not yet done are
ingested again (ingestion skips what is already stored, so nothing is duplicated); a file whose upload
is gone is marked failed. Nothing is ever silently dropped.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from blend_engine.cancel import Cancelled, StopCheck, never
from corpus_tools.documents import Document, Reader, resolve_doc_id
from corpus_tools.pipeline import IngestPipeline

logger = logging.getLogger(__name__)

JOBS_FILE = "jobs.sqlite3"
UPLOADS_DIR = "uploads"
FINAL = ("done", "failed", "cancelled")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, kind TEXT NOT NULL, status TEXT NOT NULL, "
    "created_at REAL NOT NULL, updated_at REAL NOT NULL, error TEXT NOT NULL DEFAULT '')",
    "CREATE TABLE IF NOT EXISTS job_files (job_id TEXT NOT NULL, idx INTEGER NOT NULL, name TEXT NOT NULL, "
    "path TEXT NOT NULL, size INTEGER NOT NULL, state TEXT NOT NULL, documents INTEGER NOT NULL DEFAULT 0, "
    "processed INTEGER NOT NULL DEFAULT 0, passages INTEGER NOT NULL DEFAULT 0, new_passages INTEGER NOT NULL "
    "DEFAULT 0, kv_computed INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '', "
    "PRIMARY KEY (job_id, idx))",
)


@dataclass
class JobFile:
    name: str
    path: str
    size: int
    state: str = "queued"
    documents: int = 0  # documents the file holds (known once parsed)
    processed: int = 0  # documents ingestion has read so far (their batches published as they fill)
    passages: int = 0
    new_passages: int = 0
    kv_computed: int = 0  # passages whose KV this job computed and stored
    error: str = ""


@dataclass
class Job:
    id: str
    kind: str  # "upload" or "sample"
    status: str
    created_at: float
    updated_at: float
    files: list[JobFile] = field(default_factory=list)
    error: str = ""

    def as_dict(self) -> dict:
        files = [asdict(f) for f in self.files]
        for f in files:
            f.pop("path")
        counts = {s: sum(f.state == s for f in self.files) for s in ("queued", "done", "failed", "cancelled")}
        return {"id": self.id, "kind": self.kind, "status": self.status, "created_at": self.created_at,
                "updated_at": self.updated_at, "error": self.error, "files": files, "counts": counts,
                "documents": sum(f.documents for f in self.files), "processed": sum(f.processed for f in self.files)}


class JobStore:
    """Job records in SQLite (thread-safe: one connection behind a lock)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            for stmt in _SCHEMA:
                self._conn.execute(stmt)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def create(self, kind: str, files: list[JobFile], job_id: str | None = None) -> Job:
        now = time.time()
        job = Job(job_id or uuid.uuid4().hex[:16], kind, "queued", now, now, files)
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("INSERT INTO jobs (id, kind, status, created_at, updated_at) VALUES (?, ?, ?, ?, ?)",
                               (job.id, kind, job.status, now, now))
            self._conn.executemany("INSERT INTO job_files (job_id, idx, name, path, size, state, error) VALUES "
                                   "(?, ?, ?, ?, ?, ?, ?)",
                                   [(job.id, i, f.name, f.path, f.size, f.state, f.error) for i, f in enumerate(files)])
            self._conn.execute("COMMIT")
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._conn.execute("SELECT id, kind, status, created_at, updated_at, error FROM jobs WHERE id = ?",
                                     (job_id,)).fetchone()
            if row is None:
                return None
            files = self._conn.execute(
                "SELECT name, path, size, state, documents, processed, passages, new_passages, kv_computed, error "
                "FROM job_files WHERE job_id = ? ORDER BY idx", (job_id,)).fetchall()
        return Job(row[0], row[1], row[2], row[3], row[4], [JobFile(*f) for f in files], row[5])

    def ids(self, statuses: Iterable[str] | None = None, limit: int = 100) -> list[str]:
        with self._lock:
            if statuses is None:
                rows = self._conn.execute("SELECT id FROM jobs ORDER BY created_at DESC LIMIT ?", (limit,))
            else:
                wanted = list(statuses)
                rows = self._conn.execute(f"SELECT id FROM jobs WHERE status IN ({', '.join('?' * len(wanted))}) "
                                          "ORDER BY created_at", wanted)
            return [r[0] for r in rows.fetchall()]

    def latest(self, kind: str) -> str | None:
        """The newest job of this kind, if any."""
        with self._lock:
            row = self._conn.execute("SELECT id FROM jobs WHERE kind = ? ORDER BY created_at DESC LIMIT 1",
                                     (kind,)).fetchone()
        return None if row is None else row[0]

    def set_status(self, job_id: str, status: str, error: str = "") -> None:
        with self._lock:
            self._conn.execute("UPDATE jobs SET status = ?, error = ?, updated_at = ? WHERE id = ?",
                               (status, error, time.time(), job_id))

    def set_file(self, job_id: str, idx: int, **values) -> None:
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._lock:
            self._conn.execute(f"UPDATE job_files SET {sets} WHERE job_id = ? AND idx = ?", (*values.values(), job_id, idx))
            self._conn.execute("UPDATE jobs SET updated_at = ? WHERE id = ?", (time.time(), job_id))


YIELD_MAX_S = 2.0  # the longest a job waits for requests to finish before its next passage (no starvation)
FIRST_SLICE = 2  # documents ingested (and published) first, so a big file answers questions within seconds


def _counted(docs: list[Document], tick: Callable[[int], None], start: int = 0) -> Iterator[Document]:
    """The documents, calling tick(n) as ingestion reads the n-th (it reads them lazily, batch by batch)."""
    for n, doc in enumerate(docs, start + 1):
        yield doc
        tick(n)


def first_slice(docs: list[Document], n: int = FIRST_SLICE) -> tuple[list[Document], list[Document]]:
    """(up to n documents to ingest first, the rest). Only documents whose id occurs once in the file go
    first: records sharing an id add up within one ingestion, and a second ingestion of the id would
    replace the first's part."""
    ids = [resolve_doc_id(d) for d in docs]
    counts: dict[str, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    first = [k for k, i in enumerate(ids) if counts[i] == 1][:n]
    chosen = set(first)
    return [docs[k] for k in first], [d for k, d in enumerate(docs) if k not in chosen]


class JobRunner:
    """Runs jobs one at a time on a daemon thread. `should_stop` (service shutdown) interrupts the current
    file at ingestion's next checkpoint and leaves the job to be resumed at the next start."""

    def __init__(self, pipeline: IngestPipeline, data_dir: Path, should_stop: StopCheck = never,
                 progress_interval_s: float = 0.5, busy: Callable[[], bool] | None = None) -> None:
        self.pipeline = pipeline
        self._busy = busy  # the engine serves requests: a job yields before each passage (YIELD_MAX_S at most)
        self.store = JobStore(Path(data_dir) / JOBS_FILE)
        self.upload_dir = Path(data_dir) / UPLOADS_DIR
        self._should_stop = should_stop
        self._interval = progress_interval_s
        self._queue: deque[str] = deque()
        self._cancelled: set[str] = set()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> list[str]:
        """Queue every job left queued or running by the previous process, then start the thread. Their ids."""
        resumed = self.store.ids(("queued", "running"))
        for job_id in resumed:
            logger.info("resuming ingestion job %s", job_id)
            self.store.set_status(job_id, "queued")
        with self._wake:
            self._queue.extend(resumed)
        thread = threading.Thread(target=self._loop, name="blendserve-jobs", daemon=True)
        thread.start()
        self._thread = thread  # set once started: close() may run on another thread at any moment
        return resumed

    def submit(self, kind: str, files: list[JobFile], job_id: str | None = None) -> Job:
        job = self.store.create(kind, files, job_id)
        with self._wake:
            self._queue.append(job.id)
            self._wake.notify()
        return job

    def new_upload_dir(self) -> tuple[str, Path]:
        """A fresh job id and the folder its uploaded files go to."""
        job_id = uuid.uuid4().hex[:16]
        folder = self.upload_dir / job_id
        folder.mkdir(parents=True, exist_ok=True)
        return job_id, folder

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a job: queued files are not ingested, the current one stops at its next checkpoint (what it
        published stays). None when there is no such job; a finished job is returned as it is."""
        job = self.store.get(job_id)
        if job is None or job.status in FINAL:
            return job
        with self._wake:
            self._cancelled.add(job_id)
            if job_id in self._queue:
                self._queue.remove(job_id)
                self._finish_cancelled(job)
        return self.store.get(job_id)

    def get(self, job_id: str) -> Job | None:
        return self.store.get(job_id)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread (the current file stops at its next checkpoint) and close the store. Idempotent."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self.store.close()

    def wait_idle(self, job_id: str, timeout_s: float) -> Job | None:
        """Poll until the job has ended (or the timeout); the job as it then is."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.store.get(job_id)
            if job is None or job.status in FINAL or time.monotonic() >= deadline:
                return job
            time.sleep(0.05)

    # ------------------------------------------------------------------ the thread
    def _stopping(self) -> bool:
        return self._closed or self._should_stop()

    def _yield_to_requests(self) -> None:
        """Before each passage's KV precompute: wait while the engine serves requests (a question asked
        during a background ingestion is decoded without a precompute between its tokens), at most
        YIELD_MAX_S, so a steady stream of requests slows the job but never stops it."""
        if self._busy is None:
            return
        deadline = time.monotonic() + YIELD_MAX_S
        while self._busy() and time.monotonic() < deadline and not self._stopping():
            time.sleep(0.02)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stopping():
                    self._wake.wait(0.5)
                if self._stopping():
                    return
                job_id = self._queue.popleft()
            job = self.store.get(job_id)
            if job is not None:
                try:
                    self._run(job)
                except Exception:  # noqa: BLE001 - a job's fault must not end the thread
                    logger.exception("ingestion job %s failed", job_id)
                    self.store.set_status(job_id, "failed", "internal error; see the service log")

    def _run(self, job: Job) -> None:
        self.store.set_status(job.id, "running")
        for idx, f in enumerate(job.files):
            if f.state in ("done", "failed", "cancelled"):
                continue
            if job.id in self._cancelled:
                break
            self._ingest_file(job.id, idx, f)
            if self._stopping() and job.id not in self._cancelled:
                return  # shutdown: the job stays running in the store and resumes at the next start
        if job.id in self._cancelled:
            self._finish_cancelled(self.store.get(job.id))
            return
        done = self.store.get(job.id)
        failed = all(f.state == "failed" for f in done.files)
        self.store.set_status(job.id, "failed" if failed else "done",
                              "no file could be ingested" if failed else "")
        if job.kind == "upload":
            shutil.rmtree(self.upload_dir / job.id, ignore_errors=True)
        logger.info("ingestion job %s: %s", job.id, "failed" if failed else "done")

    def _finish_cancelled(self, job: Job) -> None:
        for idx, f in enumerate(job.files):
            if f.state not in ("done", "failed"):
                self.store.set_file(job.id, idx, state="cancelled")
        self.store.set_status(job.id, "cancelled")
        if job.kind == "upload":
            shutil.rmtree(self.upload_dir / job.id, ignore_errors=True)
        self._cancelled.discard(job.id)

    def _parse_file(self, job_id: str, idx: int, f: JobFile) -> tuple[list[Document], list[str]] | None:
        """The file's documents and the reader's problems (named by the file's name, not its path); None when
        the file is gone or holds nothing to ingest, and is marked failed."""
        path = Path(f.path)
        if not path.is_file():
            self.store.set_file(job_id, idx, state="failed", error="the uploaded file is gone (lost before a restart)")
            return None
        self.store.set_file(job_id, idx, state="parsing", error="")
        reader = Reader(on_error=lambda m: None)
        docs = list(reader.read_file(path, f.name))
        problems = [m.replace(str(path), f.name) for m in reader.errors]
        if not docs:
            self.store.set_file(job_id, idx, state="failed", error="; ".join(problems) or f"{f.name}: nothing to ingest")
            return None
        return docs, problems

    def _ingest_file(self, job_id: str, idx: int, f: JobFile) -> None:
        parsed = self._parse_file(job_id, idx, f)
        if parsed is None:
            return
        docs, problems = parsed
        self.store.set_file(job_id, idx, state="ingesting", documents=len(docs), processed=0)
        last = [0.0]

        def tick(n: int) -> None:
            now = time.monotonic()
            if n == len(docs) or now - last[0] >= self._interval:
                last[0] = now
                self.store.set_file(job_id, idx, processed=n)

        def stop() -> bool:
            return self._stopping() or job_id in self._cancelled

        head, rest = first_slice(docs)
        passages = new = kv = 0
        errors: list[str] = []
        try:
            for start, part in ((0, head), (len(head), rest)):  # a few documents first: answers within seconds
                if part:
                    s = self.pipeline.ingest(_counted(part, tick, start), progress=False, publish="batch",
                                             should_stop=stop, pace=self._yield_to_requests)
                    passages, new, kv = passages + s.passages, new + s.new_passages, kv + s.kv_computed
                    errors += s.errors
        except Cancelled:
            state = "cancelled" if job_id in self._cancelled else "queued"  # shutdown: resumed at the next start
            self.store.set_file(job_id, idx, state=state)
            return
        except Exception as exc:  # noqa: BLE001 - a storage fault fails this file, named, and the job goes on
            logger.exception("ingesting %s failed", f.name)
            self.store.set_file(job_id, idx, state="failed", error=f"{type(exc).__name__}: {exc}")
            return
        self.store.set_file(job_id, idx, state="done" if passages else "failed", processed=len(docs),
                            passages=passages, new_passages=new, kv_computed=kv, error="; ".join(problems + errors))
