"""What the routes ask of the engine: a query runs on the event loop and awaits the engine client.

    route --> QueryRun.start: admission                                           (event loop)
              retrieval (embedding, rerank), the layout (tokenizing), the plan    (a query thread,
              (chunk keys, block hashes)                                           niced, awaited:
                                                                                   `host_work`)
          --> EngineClient: the engine loop prefills and decodes its n choices    (engine loop)
          <-- QueryRun.deltas(): the sources, then each choice's text as decoded  (event loop)

Nothing slow runs on the event loop, so one request's retrieval never stalls another's stream. A
request that ends early (client gone, timeout) aborts its stream; the engine drops it at its next
step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

from starlette.concurrency import run_in_threadpool

from app.conversation import exchanges_to_drop
from app.timing import clock
from app.worker import EngineWorker, Job
from blend_engine.cancel import DeadlineExceeded
from blend_engine.client import EngineClient, RequestStream
from blend_engine.errors import InputError, Overloaded, StorageError
from blend_engine.explain import Explanation
from blend_engine.layout import PromptLayout
from blend_engine.scheduler.admission import Ticket
from blend_engine.types import BlendPlan, BlendReport, BlendResult, GenerationConfig, Mode, TokenLogprob, Turn
from retrieval.lexical import NO_FILTERS, Filters
from retrieval.text import format_passage

logger = logging.getLogger(__name__)
HostRun = Callable[..., Any]  # awaits fn(*args) off the event loop (`host_work.HostWork.run`)


class ServiceError(Exception):
    status_code = 500
    code = "internal_error"
    headers: dict[str, str] | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ServiceError):
    status_code = 400
    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class Busy(ServiceError):
    status_code = 503
    code = "overloaded"
    headers = {"Retry-After": "1"}

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}


class NotReady(ServiceError):
    status_code = 503
    code = "not_ready"
    headers = {"Retry-After": "5"}


class NoPassagesYet(ServiceError):
    """Nothing is searchable yet (the first start's sample corpus is still on its first batch): retry soon."""

    status_code = 503
    code = "index_empty"
    headers = {"Retry-After": "2"}


class RequestTimeout(ServiceError):
    status_code = 504
    code = "timeout"


class StorageFault(ServiceError):
    """A store could not be read or written: never the caller's fault. 507 when the disk is full."""

    status_code = 503
    code = "storage_error"
    headers = {"Retry-After": "5"}

    def __init__(self, message: str, insufficient_storage: bool = False) -> None:
        super().__init__(message)
        if insufficient_storage:
            self.status_code = 507
            self.code = "insufficient_storage"
            self.headers = None


def storage_fault(exc: BaseException) -> StorageFault:
    """The service error for a storage exception (StorageError, sqlite3.Error, OSError), naming its cause."""
    text = str(exc) or type(exc).__name__
    full = "disk is full" in text or "No space left" in text or getattr(exc, "errno", None) == 28
    return StorageFault(f"storage fault: {text}", insufficient_storage=full)


@dataclass(frozen=True)
class SuppliedDocument:
    """A passage the caller brings instead of retrieval."""

    text: str
    title: str | None = None


@dataclass(frozen=True)
class QuerySpec:
    """A query as the engine sees it, built from either endpoint's request."""

    question: str
    top_k: int
    documents: tuple[SuppliedDocument, ...] | None
    mode: Mode
    recompute_ratio: float | None
    gen: GenerationConfig
    system_prompt: str | None = None
    explain: bool = False
    explain_max_tokens: int = 4096
    retrieval: str | None = None  # dense / lexical / hybrid; None = the retriever's default (settings)
    filters: Filters = NO_FILTERS
    turns: tuple[Turn, ...] = ()  # a conversation's earlier messages, oldest first
    search: str | None = None  # what retrieval searches for (None: the question)
    numbered: bool = True  # `[n]` before passage n, so that answers can cite it
    n: int = 1  # completions sampled for the one prompt
    cache_salt: str | None = None  # the request's KV namespace (with the API key's, `tenancy`)
    source_chars: int | None = None  # a source's text is cut to this many characters (None: whole passage)


@dataclass(frozen=True)
class PassageRef:
    """A passage an answer was built from, in prompt order: the store's passage id (a supplied
    document's KV key), its title ("" when none), its retrieval score (None when supplied), its
    document and its index in it (`seq`; a supplied document: None and its index in `documents`)."""

    id: str
    title: str
    score: float | None = None
    doc_id: str | None = None  # retrieved passages: their document, and where in it (page / heading path)
    location: str | None = None
    seq: int = 0  # the passage's index in its document (a supplied one: in `documents`)
    text: str = ""  # the passage as stored (a supplied document's text), cut to `QuerySpec.source_chars`
    truncated: bool = False  # `text` was cut


@dataclass(frozen=True)
class Choice:
    """One sampled completion of the prompt."""

    index: int
    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked


@dataclass(frozen=True)
class StreamDelta:
    """A piece of one choice's text, as it is decoded."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens this text came from, when asked
    sources: tuple[PassageRef, ...] = ()  # set on the one delta sent before the first token: the cited passages


@dataclass(frozen=True)
class QueryOutcome:
    """A finished query as domain data; `app.presenters` turns it into either endpoint's body."""

    answer: str
    passages: tuple[PassageRef, ...]
    report: BlendReport
    finish_reason: str
    completion_tokens: int
    retrieval_ms: float  # arrival until the passages are known (`app.timing`: the parts add up)
    ttft_ms: float  # arrival until the first token: retrieval + plan + queue + prefill
    total_ms: float  # arrival until the last token: ttft + decode
    queue_ms: float
    store_ms: float
    plan_ms: float = 0.0  # layout, tokenizing, chunk keys, mode plan, block hashes, submit
    prefill_ms: float = 0.0  # admitted to the batch until the first token
    decode_ms: float = 0.0  # first token until the last
    explanation: Explanation | None = None  # the engine's, when the request asked for explain
    fallback: str | None = None  # why a blend request was answered another way (fidelity gate)
    choices: tuple[Choice, ...] = ()  # every completion (n of them); the first is `answer`
    search: str = ""  # what retrieval searched for
    turns: int = 0  # earlier conversation messages in the prompt
    notes: tuple[str, ...] = ()  # what the service changed to answer (a trimmed conversation)
    decoder: dict[str, Any] | None = None  # the vLLM decoder's split of the time (`vllm_decoder.DecoderSplit`)


# ====================================================================== the query, on the event loop
def _passages(stack, spec: QuerySpec) -> tuple[list[str], tuple[PassageRef, ...]]:
    engine = stack.engine
    if spec.documents is not None:
        texts = [format_passage(d.text, d.title) for d in spec.documents]
        out = tuple(PassageRef(id=engine.key_of(engine.passage_tokens(t)), title=d.title or "", score=None, seq=i,
                               **_text(d.text, spec.source_chars))
                    for i, (t, d) in enumerate(zip(texts, spec.documents)))
        return texts, out
    hits = stack.retriever.search(spec.search or spec.question, spec.top_k, mode=spec.retrieval, filters=spec.filters)
    if not hits and not spec.filters.empty:
        raise BadRequest("no passages match the filters (or none matched the question's words in lexical retrieval)")
    if not hits and stack.pipeline.db.counts()["passages"] == 0:
        raise NoPassagesYet("no passage is searchable yet: the corpus is still being ingested (see `ingestion`); "
                            "retry shortly, ingest documents, or pass `documents`")
    if not hits:
        raise BadRequest("no passages match the question (lexical retrieval found none of its words)")
    texts = [format_passage(h.text, h.title) for h in hits]
    out = tuple(PassageRef(id=str(h.id), title=h.title or "", score=float(h.score), doc_id=h.doc_id,
                           location=h.location, seq=h.seq, **_text(h.text, spec.source_chars)) for h in hits)
    return texts, out


def _text(text: str, limit: int | None) -> dict:
    """A source's text fields: the passage, cut to `limit` characters when it is longer."""
    cut = limit is not None and len(text) > limit
    return {"text": text[:limit] if cut else text, "truncated": cut}


def fit_turns(engine, plan: BlendPlan, max_new_tokens: int) -> tuple[BlendPlan, PromptLayout, tuple[str, ...]]:
    """The plan's layout, built once; a conversation that does not fit the model context loses its
    oldest exchanges first (with a note, and the layout built again).

    Each turn is a segment tokenized alone, so dropping the first d turns frees exactly their tokens."""
    layout = engine.layout(plan)
    if not plan.turns:
        return plan, layout, ()
    limit = engine.runner.shape.max_positions
    sizes = [len(s.token_ids) for s in layout.segments if s.kind == "turn"]
    if len(sizes) != len(plan.turns):  # a layout without the conversation: nothing to trim
        return plan, layout, ()
    drop = exchanges_to_drop(sizes, [t.role for t in plan.turns], layout.n_tokens + max_new_tokens - limit)
    if not drop:
        return plan, layout, ()
    note = (f"conversation trimmed: the {drop} oldest of {len(plan.turns)} earlier messages were left out "
            f"({sum(sizes[:drop])} tokens) to fit the model context of {limit} tokens with "
            f"{max_new_tokens} new tokens")
    logger.info(note)
    plan = replace(plan, turns=plan.turns[drop:])
    return plan, engine.layout(plan), (note,)


def _prepared(engine, client, plan: BlendPlan, gens: list[GenerationConfig]):
    """(plan, layout, notes, the client's prep): the host work before submitting, on a worker thread:
    tokenizing the layout (a conversation trimmed to fit), then what the client plans from it (the
    engine's chunk keys, mode plan and block hashes; `client.prepare`)."""
    plan, layout, notes = fit_turns(engine, plan, max(g.max_tokens for g in gens))
    return plan, layout, notes, client.prepare(plan, gens, layout)


@dataclass(frozen=True)
class _Marks:
    """A query's instants on `clock`: arrival at the HTTP server, passages known, submitted to the engine."""

    arrival: float
    retrieved: float
    submitted: float


GATE_CHECKING = "full_prefill: the start-up fidelity gate is still checking blend"


def _gated_mode(stack, mode: Mode) -> tuple[Mode, str | None]:
    """Blend falls back to full prefill while the enforced start-up fidelity gate is failed or still running."""
    if mode is Mode.BLEND and getattr(stack, "gate_checking", False) and stack.settings.engine.fidelity_gate == "enforce":
        return Mode.FULL_PREFILL, GATE_CHECKING
    gate = getattr(stack, "gate", None)
    if mode is Mode.BLEND and gate is not None and gate.fallback:
        return Mode.FULL_PREFILL, gate.reason
    return mode, None


def _choice_config(gen: GenerationConfig, index: int) -> GenerationConfig:
    """Choice `index`'s sampling: with a seed, seed + index (reproducible, yet n different samples)."""
    return gen if index == 0 or gen.seed is None else replace(gen, seed=gen.seed + index)


class QueryRun:
    """One query on the event loop: `start` retrieves, plans and submits it (errors raise there,
    before any byte is sent); `deltas()` yields the sources (one `StreamDelta` just before the
    first token) and then each choice's text; `outcome()` once they ended. `abort()` stops it."""

    def __init__(self, spec: QuerySpec, passages: tuple[PassageRef, ...], plan: BlendPlan, stream: RequestStream,
                 marks: _Marks, fallback: str | None, notes: tuple[str, ...]) -> None:
        self.spec, self.passages, self.plan, self.stream = spec, passages, plan, stream
        self._marks, self._fallback, self._notes = marks, fallback, notes
        self._ended: float | None = None  # when the last token reached the event loop

    @classmethod
    async def start(cls, stack, client: EngineClient, spec: QuerySpec, timeout_s: float,
                    arrival: float | None = None, host: HostRun = run_in_threadpool) -> QueryRun:
        """Retrieve (unless documents are given), lay the prompt out once and submit its `spec.n`
        choices. Raises the service's errors (400, 503 Busy / NoPassagesYet, storage faults).
        `arrival`: when the HTTP server got the request (`app.timing`; default now): timings and the
        deadline count from it. `host` runs the host work off the event loop (`host_work.HostWork.run`)."""
        t0 = arrival if arrival is not None else clock()
        with _service_errors():
            ticket = client.admit(timeout_s)  # refused before any retrieval or tokenizing is spent on it
            try:
                return await cls._submit(stack, client, spec, timeout_s, ticket, t0, host)
            finally:
                ticket.release()  # a no-op once the engine took it

    @classmethod
    async def _submit(cls, stack, client: EngineClient, spec: QuerySpec, timeout_s: float, ticket: Ticket,
                      t0: float, host: HostRun) -> QueryRun:
        texts, passages = await host(_passages, stack, spec)
        retrieved = clock()
        mode, fallback = _gated_mode(stack, spec.mode)
        plan = BlendPlan(passages=tuple(texts), question=spec.question, mode=mode,
                         recompute_ratio=spec.recompute_ratio, system_prompt=spec.system_prompt,
                         explain=spec.explain, turns=spec.turns, numbered=spec.numbered, cache_salt=spec.cache_salt)
        gens = [_choice_config(spec.gen, i) for i in range(spec.n)]
        plan, layout, notes, prep = await host(_prepared, stack.engine, client, plan, gens)
        submitted = clock()
        stream = client.submit(plan, gens, timeout_s - (submitted - t0), layout, ticket, prep=prep)
        return cls(spec, passages, plan, stream, _Marks(t0, retrieved, submitted), fallback, notes)

    async def deltas(self) -> AsyncIterator[StreamDelta]:
        """The sources first, then every piece of text (or logprobs) as the engine decodes it."""
        sent_sources = False
        with _service_errors():
            async for index, delta in self.stream:
                if not (delta.text or delta.logprobs):
                    continue
                if not sent_sources:
                    sent_sources = True
                    yield StreamDelta(index, "", sources=self.passages)
                yield StreamDelta(index, delta.text, delta.logprobs)
        self._ended = clock()

    async def finish(self) -> None:
        """Run to the end without streaming (then `outcome()`)."""
        async for _ in self.deltas():
            pass

    def abort(self) -> None:
        self.stream.abort()

    def outcome(self) -> QueryOutcome:
        results: list[BlendResult] = list(self.stream.results)
        result, m = results[0], self._marks
        choices = tuple(Choice(i, r.text, r.finish_reason, len(r.token_ids), r.logprobs) for i, r in enumerate(results))
        ttft_ms = (m.submitted - m.arrival) * 1e3 + result.ttft_ms  # the engine's clock is `clock` too
        total_ms = max(((self._ended or clock()) - m.arrival) * 1e3, ttft_ms)
        return QueryOutcome(
            answer=result.text, passages=self.passages, report=result.report, finish_reason=result.finish_reason,
            completion_tokens=len(result.token_ids), retrieval_ms=(m.retrieved - m.arrival) * 1e3, ttft_ms=ttft_ms,
            total_ms=total_ms, plan_ms=(m.submitted - m.retrieved) * 1e3, prefill_ms=result.ttft_ms - result.queue_ms,
            decode_ms=total_ms - ttft_ms,
            queue_ms=result.queue_ms, store_ms=results[-1].store_ms, explanation=result.explanation,
            fallback=self._fallback, choices=choices, search=self.spec.search or self.spec.question,
            turns=len(self.plan.turns), notes=self._notes, decoder=self._decoder())

    def _decoder(self) -> dict[str, Any] | None:
        """With the vLLM decoder: blend, hand-over and vLLM times (its stream's `split`)."""
        split = getattr(self.stream, "split", None)
        return None if split is None else asdict(split)


@contextmanager
def _service_errors() -> Iterator[None]:
    """The engine's errors as the service's: input -> 400, admission -> 503 Busy, deadline -> 504,
    storage -> a logged 5xx."""
    try:
        yield
    except InputError as exc:  # the engine's and the plan's input errors (context overflow, ...)
        raise BadRequest(str(exc)) from exc
    except Overloaded as exc:
        raise Busy(str(exc), exc.retry_after_s) from exc
    except DeadlineExceeded as exc:
        raise RequestTimeout(str(exc)) from exc
    except StorageError as exc:  # not the caller's fault: a logged, counted 5xx
        raise storage_fault(exc) from exc


# ====================================================================== blocking jobs (ingestion, verify)
async def run_job(worker: EngineWorker, fn: Callable[[Job], Any], timeout_s: float, name: str = "job") -> Any:
    """A blocking job (document ingestion, store verification) on the worker threads, awaited."""
    try:
        return await worker.run(fn, timeout_s, name)
    except (TimeoutError, asyncio.TimeoutError):
        raise RequestTimeout(f"request exceeded the timeout of {timeout_s:g} s") from None
