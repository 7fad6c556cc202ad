"""Request and response models. Static shape checks live here; limits that come from Settings
(question length, documents, top_k, max_tokens) are checked in `app.validation.check_limits`.

Request models are strict: JSON types are not coerced ("0.3" is not a number, true is not 1; an
integer is still a valid float) and NaN / Infinity are refused."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from logsafe import has_control

ModeName = Literal["blend", "full_prefill", "prefix_cache", "full_reuse"]
RetrievalName = Literal["dense", "lexical", "hybrid"]


_REQUEST = ConfigDict(strict=True, allow_inf_nan=False)


def _not_blank(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty or whitespace")
    return v


def _printable_id(v: str | None) -> str | None:
    """Document ids must be addressable in a URL path and safe to log: no control characters."""
    if v is not None and has_control(v):
        raise ValueError("must not contain control characters (newline, carriage return, tab, escape, ...)")
    return v


# ====================================================================== /v1/query
class InlineDocument(BaseModel):
    model_config = ConfigDict(extra="forbid", **_REQUEST)

    title: str | None = None
    text: str = Field(min_length=1)

    _text_not_blank = field_validator("text")(_not_blank)


def _epoch_seconds(v: float | str | None) -> float | None:
    """Seconds since the epoch, or an ISO 8601 date / date-time (UTC when it names no zone)."""
    if v is None or isinstance(v, (int, float)):
        return v
    try:
        when = datetime.fromisoformat(v.strip())
    except ValueError:
        raise ValueError("must be seconds since the epoch or an ISO 8601 date (2024-05-01, 2024-05-01T12:00:00Z)") from None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


class SearchFilters(BaseModel):
    """Metadata filters on retrieval (every mode): all given ones must hold."""

    model_config = ConfigDict(extra="forbid", **_REQUEST)

    source: str | None = Field(None, description="the passage's source, exactly (e.g. `api`, `upload`, `hotpotqa`)")
    doc_id_prefix: str | None = Field(None, min_length=1, description="document ids starting with this")
    ingested_after: float | str | None = Field(None, description="ingested at or after (epoch seconds or ISO 8601)")
    ingested_before: float | str | None = Field(None, description="ingested before (epoch seconds or ISO 8601)")

    _times = field_validator("ingested_after", "ingested_before")(_epoch_seconds)


class QueryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", **_REQUEST, json_schema_extra={"examples": [
        {"question": "Which city hosted the 1936 Summer Olympics?", "top_k": 5},
    ]})

    question: str = Field(min_length=1, description="the question to answer")
    top_k: int = Field(5, ge=1, description="passages to retrieve when no documents are given")
    documents: list[InlineDocument] | None = Field(
        None, min_length=1, description="use exactly these passages, in this order, instead of retrieval"
    )
    mode: ModeName | None = Field(None, description="defaults to BLENDSERVE_ENGINE_DEFAULT_MODE (blend)")
    retrieval: RetrievalName | None = Field(None, description="dense, lexical or hybrid; null = BLENDSERVE_RETRIEVAL_METHOD")
    filters: SearchFilters | None = Field(None, description="retrieve only passages matching these")
    recompute_ratio: float | None = Field(None, ge=0, le=1, description="blend only; null = server default")
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0, le=2)
    ignore_eos: bool = Field(False, description="decode through end-of-sequence up to max_tokens (for benchmarks, "
                                                "as vLLM's ignore_eos)")
    stream: bool = False
    explain: bool = Field(False, description="add `explain`: per passage token, recomputed or not, its check-layer "
                                             "score, and the passage's cache hit/miss and tier (see docs/api.md)")
    logprobs: bool = Field(False, description="add `logprobs`: each answer token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the k most likely tokens too")
    cache_salt: str | None = Field(None, min_length=1, max_length=256,
                                   description="KV cache namespace: only requests with the same salt share cached KV")

    _question_not_blank = field_validator("question")(_not_blank)


class PassageOut(BaseModel):
    id: str
    title: str
    score: float | None = None
    doc_id: str | None = Field(None, description="the retrieved passage's document (null for inline documents)")
    location: str | None = Field(None, description="where in its document: `page 3` (PDF) or a heading path "
                                                   "(`Guide > Install`; HTML, DOCX, uploads); empty when none")


class SourceOut(BaseModel):
    """A passage the answer was given, numbered as in the prompt: the model cites it as `[index]`."""

    index: int = Field(description="the passage's number in the prompt, from 1 (cited as [index])")
    id: str = Field(description="the passage id (a supplied document's KV key)")
    doc_id: str | None = Field(description="its document; null for a supplied document")
    title: str
    passage: int = Field(description="its index in its document (a supplied document: its index in `documents`)")
    location: str | None = Field(None, description="where in its document: page or heading path (null when none)")
    score: float | None = Field(description="retrieval score; null for a supplied document")
    text: str = Field("", description="the cited passage as stored (cut to BLENDSERVE_LIMITS_SOURCE_TEXT_CHARS when set)")
    truncated: bool = Field(False, description="`text` was cut to BLENDSERVE_LIMITS_SOURCE_TEXT_CHARS")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class LogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    """OpenAI's chat `logprobs`: one entry per generated token."""

    content: list[LogprobEntry] | None = None
    refusal: None = None


class Timings(BaseModel):
    """From the request's arrival at the HTTP server (`app.timing`): ttft_ms = retrieval_ms + plan_ms +
    queue_ms + prefill_ms; total_ms = ttft_ms + decode_ms; kv_load_ms and recompute_ms are prefill's parts."""

    retrieval_ms: float
    kv_load_ms: float
    recompute_ms: float
    ttft_ms: float
    total_ms: float
    queue_ms: float = 0.0
    plan_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    kv_store_ms: float = 0.0
    # BLENDSERVE_DECODER_KIND=vllm: Blendserve's prefill until the KV was handed over (0: not blended), the
    # copy into shared memory (part of it), vLLM's first token and whole request (from when it was sent)
    blend_ms: float | None = None
    handover_ms: float | None = None
    decoder_ttft_ms: float | None = None
    decoder_ms: float | None = None


class QueryStats(BaseModel):
    context_tokens: int
    recomputed_tokens: int
    recompute_ratio: float
    cache_hits: int
    cache_misses: int
    prefix_tokens_reused: int = 0  # prompt tokens taken from the KV pool's prefix cache (an exact repeat's)
    ratio_source: str = ""
    completion_tokens: int = 0
    fallback: str | None = None
    decoder: Literal["own", "vllm"] = "own"  # who decoded (BLENDSERVE_DECODER_KIND)
    decoder_cached_tokens: int | None = None  # vllm: prompt tokens vLLM did not compute (handed KV + its prefix cache)


class QueryResponse(BaseModel):
    answer: str
    passages: list[PassageOut]
    mode: ModeName
    finish_reason: str
    timings: Timings
    stats: QueryStats
    sources: list[SourceOut] = []
    logprobs: ChoiceLogprobs | None = None


CacheStatus = Literal["hit", "miss", "off"]


class SystemExplain(BaseModel):
    """The chat template's system prefix (cached alone at position 0; exact, so blend never recomputes it)."""

    n_tokens: int
    recomputed_tokens: int
    cache: CacheStatus
    tier: str | None = None


class PassageExplain(BaseModel):
    """One passage, in prompt order (the same order as `passages`). `tokens`, `recomputed` and
    `scores` are aligned and hold the first `len(tokens)` of `n_tokens` tokens (fewer when the
    request's explain budget ran out: `truncated`); the counts always cover every token."""

    index: int = Field(description="position in `passages`")
    id: str
    title: str
    n_tokens: int
    recomputed_tokens: int = Field(description="tokens in the final recomputed set, over all n_tokens")
    cache: CacheStatus = Field(description="hit: KV loaded; miss: recomputed whole; off: this mode loads nothing")
    tier: str | None = Field(None, description="the store tier that held the KV (hits): memory, disk, redis, prefix")
    tokens: list[str] = Field(description="token text pieces; joined they give the passage text")
    recomputed: list[bool]
    scores: list[float | None] = Field(description="check-layer score that ranked the token; null when it did "
                                                   "not compete (mode, or the passage missed)")
    truncated: bool = False


class QuestionExplain(BaseModel):
    """The question and the chat template's suffix: never cached, always recomputed."""

    n_tokens: int
    recomputed_tokens: int
    tokens: list[str]
    recomputed: list[bool]
    truncated: bool = False


class Explain(BaseModel):
    """`system.recomputed_tokens + passage_recomputed_tokens + question.recomputed_tokens` plus the
    markers' and turns' `recomputed_tokens` `== stats.recomputed_tokens`, cut or not."""

    check_layer: int | None = Field(description="blend's check layer; null in modes that rank nothing")
    metric: str = Field(description="what a score is, e.g. 'k deviation x question attention'")
    max_tokens: int = Field(description="BLENDSERVE_LIMITS_EXPLAIN_MAX_TOKENS: tokens listed at most, in prompt order")
    explained_tokens: int = Field(description="tokens listed (passages and question)")
    truncated: bool = Field(description="true when some tokens were not listed")
    passage_recomputed_tokens: int
    system: SystemExplain
    passages: list[PassageExplain]
    question: QuestionExplain
    markers: list[SystemExplain] = Field([], description="the `[n]` before passage n, in prompt order")
    turns: list[SystemExplain] = Field([], description="a conversation's earlier messages, in prompt order")


class QueryExplainedResponse(QueryResponse):
    """The response to `explain: true`."""

    explain: Explain


# ====================================================================== documents
class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid", **_REQUEST)

    text: str = Field(min_length=1)
    title: str = ""
    doc_id: str | None = Field(None, min_length=1, max_length=200,
                               description="no control characters; re-ingesting a doc_id replaces the document")

    _text_not_blank = field_validator("text")(_not_blank)
    _id_printable = field_validator("doc_id")(_printable_id)


class IngestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", **_REQUEST)

    documents: list[DocumentIn] = Field(min_length=1)


class IngestResponse(BaseModel):
    documents: int
    passages: int
    new_passages: int
    skipped: int
    tokens: int
    kv_bytes: int
    seconds: float
    errors: list[str] = []
    doc_ids: list[str] = []
    kv_computed: int = 0
    kv_seconds: float = 0.0
    embed_seconds: float = 0.0
    index_seconds: float = 0.0


# ====================================================================== OpenAI chat and completions
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", **_REQUEST)

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if not self.content:
            return ""
        return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", **_REQUEST)

    include_usage: bool = False


class _OpenAIRequest(BaseModel):
    """What chat and completions share. OpenAI fields this server cannot honour are declared so that
    `app.openai_fields.refuse_unsupported` can answer them with a 400 naming the field (unless the
    value changes nothing, such as `tools: []`); fields nobody declared are a 400 too (OpenAI's
    "unrecognized request argument"), except the informational ones listed there."""

    model_config = ConfigDict(extra="allow", **_REQUEST)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=8, description="completions to sample (1-8)")
    stop: str | list[str] | None = Field(None, description="up to 4 strings; generation stops before any of them")
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256,
                                   description="KV cache namespace: only requests with the same salt share cached KV")
    # blend extras (`extra_body` in the openai client)
    top_k: int = Field(5, ge=1)
    documents: list[InlineDocument] | None = Field(None, min_length=1)
    mode: ModeName | None = None
    retrieval: RetrievalName | None = None
    filters: SearchFilters | None = None
    recompute_ratio: float | None = Field(None, ge=0, le=1)
    explain: bool = Field(False, description="add `blend.explain` (see /v1/query)")
    # declared to be refused unless neutral (app.openai_fields)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not x for x in stops):
            raise ValueError("stop sequences must not be empty")
        return v


class ChatCompletionRequest(_OpenAIRequest):
    """OpenAI's chat request. Blend extras may be sent with the client's `extra_body`: top_k,
    documents, mode, retrieval, filters, recompute_ratio, explain, cache_salt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens (wins when both are set)")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_OpenAIRequest):
    """OpenAI's (legacy) completions request: `prompt` is answered as a question, with retrieval."""

    prompt: str | list[str] = Field(description="the question (a list: exactly one string)")
    logprobs: int | None = Field(None, ge=0, le=20, description="log-probabilities of each token and of the k "
                                                                "most likely alternatives")
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatChoiceMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the cache, not recomputed")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    passages: list[PassageOut]
    sources: list[SourceOut]
    notes: list[str] = Field([], description="what the server changed to answer, e.g. a trimmed conversation")
    blend: dict[str, Any]


class CompletionLogprobs(BaseModel):
    """The legacy completions format."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    passages: list[PassageOut]
    sources: list[SourceOut]
    notes: list[str] = []
    blend: dict[str, Any]


# ====================================================================== health
class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    """With an API key set, unauthenticated callers get only ready, status and reason."""

    ready: bool
    status: str
    reason: str | None = None
    model: str | None = None
    index: dict[str, Any] | None = None
    store: dict[str, Any] | None = None
    sync: dict[str, Any] | None = None  # the index against the passage store's change log (generation, lag)
    fidelity: dict[str, Any] | None = None
    blend: dict[str, Any] | None = None  # {state: checking | on | off, reason}: the fidelity gate's verdict
    ingestion: dict[str, Any] | None = None  # the sample job's progress (status, documents, processed, passages, eta_s)
    error: str | None = None


# ====================================================================== upload jobs
JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
FileState = Literal["queued", "parsing", "ingesting", "done", "failed", "cancelled"]


class JobFileOut(BaseModel):
    name: str
    size: int
    state: FileState
    documents: int = Field(description="documents the file holds (known once parsed)")
    processed: int = Field(description="documents read by ingestion so far (published batch by batch)")
    passages: int = Field(description="passages of the file (done)")
    new_passages: int = Field(description="passages that were not stored before (embedded and indexed)")
    kv_computed: int = Field(description="passages whose KV this job computed and stored")
    error: str = Field(description="why the file failed, or warnings about parts of it")


class JobOut(BaseModel):
    id: str
    kind: Literal["upload", "sample"]
    status: JobStatus
    created_at: float
    updated_at: float
    error: str
    documents: int
    processed: int
    counts: dict[str, int] = Field(description="files by state: queued, done, failed, cancelled")
    files: list[JobFileOut]


class JobsOut(BaseModel):
    jobs: list[JobOut]
