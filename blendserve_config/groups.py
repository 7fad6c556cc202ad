"""The setting groups: one pydantic model per concern, read from `BLENDSERVE_<GROUP>_<FIELD>`.

`blendserve_config.settings.Settings` composes the shared groups (model, engine, store, retrieval,
ingest); `app.settings.ServiceSettings` adds the service's (service, limits, auth, decoder). Every group
is defined here, so the environment reader knows every valid name whichever class reads it.
Cheap to import (no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from blend_engine.types import Mode
from retrieval import lexical

SAMPLE_CORPUS = Path(__file__).resolve().parent.parent / "sample_corpus" / "hotpotqa_sample.jsonl"


def empty_is_none(v: object) -> object:
    """An optional setting given as an empty or blank string (`BLENDSERVE_STORE_REDIS_URL=`) is unset."""
    return None if isinstance(v, str) and not v.strip() else v


class Group(BaseModel):
    """A settings group: unknown fields are errors, values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSettings(Group):
    """The model the engine runs."""

    name: str = Field("smollm2-135m-instruct", description="a model name from docs/models.md or a local folder")
    device: str = Field("auto", description="auto = CUDA when available, else the CPU")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    linear_dtype: Literal["auto", "bfloat16"] = Field(
        "auto", description="bfloat16: a float32 model on the CPU runs its projections and lm_head on bf16 copies "
                            "of their weights (on CPUs with native bf16 matmuls, measured: faster from ~8 rows a step, "
                            "slower for one; K/V, attention and norms stay float32; refused on other CPUs and "
                            "devices); auto = the model's dtype")
    packed_weights: bool = Field(
        True, description="a float32 model on the CPU keeps each projection weight de-quantized from a GGUF block code "
                          "(Q4_1, Q8_0) in that code too, read by steps of up to 224 rows (decode, small prefills; "
                          "the limit measured at load, where MKL gets faster: 23 rows on an AVX-512 Xeon): the "
                          "same outputs bit for bit from ~1/5 of the bytes; false = float32 only")
    cache_dir: Path | None = Field(None, description="folder where a GGUF model is prepared once (de-quantized into "
                                                     "its run dtype); unset = ~/.cache/blendserve/models")

    _empty = field_validator("cache_dir", mode="before")(empty_is_none)


class EngineSettings(Group):
    """The CacheBlend engine: modes, the recompute ratio, continuous batching."""

    default_mode: Mode = Mode.BLEND
    recompute_ratio: float | None = Field(None, ge=0, le=1, description="fixed ratio; unset = controller")
    ratio_floor: float = Field(0.15, ge=0, le=1)
    ratio_max: float = Field(0.5, ge=0, le=1)
    selected_attention: Literal["auto", "blocks", "sdpa_mask", "flex"] = Field(
        "auto", description="how a prefill's rows attend: auto = a C++ kernel on the CPU (float32, head dim "
                            "16 x 1..8; else blocks), one boolean-mask SDPA on a GPU; blocks = position-ordered "
                            "SDPA calls on the CPU; flex = FlexAttention (compiled on CUDA at first use)")
    decode_attention: Literal["auto", "pooled", "per_sequence"] = Field(
        "auto", description="how a decode step attends: pooled = one call a layer over the KV pool (a kernel "
                            "reading the pool in place: Triton on CUDA, C++ on the CPU, built once per machine; "
                            "else keys gathered for one SDPA); per_sequence = one call per sequence; auto = "
                            "pooled, except on a CPU where the C++ kernel cannot be built (a warning says why): "
                            "per_sequence")
    decode_graphs: Literal["auto", "off"] = Field(
        "auto", description="auto = on CUDA, replay pooled decode steps as CUDA graphs (captured per batch size "
                            "and key-length bucket on first use); off = always run them eagerly. No effect on "
                            "the CPU")
    max_batch: int = Field(16, ge=1, le=256, description="requests the engine loop prefills and decodes at once "
                                                         "(continuous batching; 16 measured best on a 2-core CPU, "
                                                         "64 for a GPU); more wait in its queue")
    batch_kv_mb: int | None = Field(None, ge=1, description="the paged KV pool: every running request's KV (blocks "
                                    "taken as tokens arrive) and the cached prefixes, in the model's dtype; a request "
                                    "that cannot fit it alone is refused (400). Unset = automatic: on the CPU 30% of "
                                    "the memory available at start-up (after the model, less the memory tier), within "
                                    "256 and 8192 blocks; on CUDA 2048 MiB (or kv_pool_gpu_fraction)")
    kv_pool_gpu_fraction: float | None = Field(None, gt=0, lt=1, description="on CUDA: size the KV pool as this "
                                               "share of the device memory free after the model (overrides "
                                               "batch_kv_mb there); unset = batch_kv_mb")
    kv_block_tokens: int = Field(16, ge=1, le=1024, description="token slots per block of the KV pool")
    kv_pool_prefault: bool = Field(False, description="on the CPU: write every page of the KV pool at start-up, "
                                   "before /readyz turns ready, so that its memory is resident from the start (a "
                                   "machine short of it fails then, not mid-request) and no request pays a page's "
                                   "first write. Matters where a VM backs guest memory lazily: there a burst of 8 "
                                   "blends beside vLLM took 4.0-5.5 s (0.9-2.4 s of it in the kernel) and 3.2-3.6 s "
                                   "(0.2 s) with it; on warm memory no difference was measured. Costs start-up "
                                   "(5.7 GiB: 1.1 s warm, 4.4 GiB 25 s on such a VM) and holds the pool's memory "
                                   "from the start; `make run-vllm` sets it (vLLM holds its KV space the same way)")
    prefix_caching: bool = Field(True, description="automatic prefix caching: a request first takes the longest "
                                                   "cached prefix of its prompt from the KV pool, in every mode")
    prefill_step_tokens: int = Field(4096, ge=1, description="while others decode, a step's prefill work is at most "
                                                             "this many tokens summed over layers: new requests' "
                                                             "cached-prefix copies first, then prefills (oldest "
                                                             "first) run layers, each layer costing its rows plus a "
                                                             "fixed overhead, sharing each layer's pass with the "
                                                             "decode rows (lower: steadier streams, slower prefills)")
    prefill_step_ms: float | None = Field(30.0, gt=0, description="while others decode, a step's prefill work is "
                                          "also cut to what this many milliseconds buy at its cost measured on "
                                          "the engine's own steps, so a stream's next token waits about this much "
                                          "more for a step that carries prefill work (steadier streams, fewer "
                                          "prefills finished under load: on 2 cores new combinations of known "
                                          "passages got 0-18% fewer tokens/s at 8 clients, 5-36% at 16, in two "
                                          "runs); empty = the token budget (prefill_step_tokens) alone")
    fidelity_gate: Literal["enforce", "warn", "off"] = Field(
        "enforce", description="start-up fidelity check: enforce = blend falls back to full prefill when it fails")

    _empty = field_validator("recompute_ratio", "kv_pool_gpu_fraction", "batch_kv_mb", "prefill_step_ms",
                             mode="before")(empty_is_none)

    @model_validator(mode="after")
    def _ratio_bounds(self) -> EngineSettings:
        if self.ratio_floor > self.ratio_max:
            raise ValueError("ratio_floor must not exceed ratio_max")
        return self


class StoreSettings(Group):
    """Where state lives: the KV cache tiers and the passage database."""

    kv_format: Literal["auto", "fp16", "bf16", "fp32", "int8"] = Field(
        "auto", description="stored KV precision; auto = bf16 for a bf16 model on CUDA, else fp16")
    memory_cache_mb: int = Field(1024, ge=0, description="memory tier budget in MiB (replaces MEMORY_CACHE_GB)")
    device_cache_gb: float | None = Field(None, ge=0, allow_inf_nan=False,
                                          description="device (GPU) hot tier above the memory tier, in GiB; unset = "
                                                      "automatic: 0 off CUDA, 20% of the device memory free after "
                                                      "the model and the batch's KV on CUDA")
    disk_cache_mb: int = Field(20480, ge=0, description="disk tier budget in MiB")
    disk_direct_io: bool = Field(False, description="layer streams read the disk tier with O_DIRECT (for drives where "
                                                    "the page cache only gets in the way)")
    redis_url: str | None = Field(None, description="redis://... = a shared KV tier below the disk; unset = none")
    redis_timeout_s: float = Field(0.5, gt=0)
    database_url: str | None = Field(None, description="postgresql://... = shared passage store; unset = SQLite "
                                                        "in data_dir")

    _empty = field_validator("redis_url", "database_url", "device_cache_gb", mode="before")(empty_is_none)

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (unset = SQLite in the data dir)")
        return v

    @property
    def memory_cache_bytes(self) -> int:
        return self.memory_cache_mb << 20


class RetrievalSettings(Group):
    """Finding the passages: embedder, index, lexical search and their fusion, reranking."""

    method: Literal["dense", "lexical", "hybrid"] = Field(
        "hybrid", description="dense = embeddings (FAISS); lexical = full-text search in the passage store (SQLite "
                              "FTS5 / PostgreSQL); hybrid = both, fused (hybrid_fusion); a request may override it")
    embedder: str = Field("", description="sentence-transformers directory; empty = bundled all-MiniLM-L6-v2")
    top_k: int = Field(5, ge=1, le=50)
    placement: Literal["score", "best_last"] = "best_last"
    hybrid_candidates: int = Field(lexical.CANDIDATES, ge=1, le=1000,
                                   description="hits each list brings to the fusion (and the reranker scores)")
    hybrid_fusion: Literal["rrf", "convex"] = Field(
        lexical.FUSION, description="convex = weighted sum of the min-max normalised dense and lexical scores of "
                                    "every candidate; rrf = reciprocal rank fusion (per-list weights)")
    hybrid_dense_weight: float = Field(lexical.DENSE_WEIGHT, ge=0, le=1,
                                       description="the dense list's weight in the fusion, the lexical one's is 1 "
                                                   "minus it (rrf: 0.5 = plain RRF)")
    hybrid_rrf_k: int = Field(lexical.RRF_K, ge=0, le=10_000, description="reciprocal rank fusion's k (rrf only)")
    lexical_title_weight: float = Field(lexical.TITLE_WEIGHT, gt=0, le=100,
                                        description="what a word of a passage's title counts in the lexical score, "
                                                    "one of its text counting 1 (BM25F-style)")
    reranker: Path | None = Field(None, description="a local sentence-transformers CrossEncoder folder that "
                                                    "rescores the candidates; unset = no reranking")
    index_type: Literal["flat", "hnsw", "ivf"] = "flat"
    index_sync_interval_s: float = Field(0.5, gt=0, le=60, description="how often the FAISS index polls the "
                                                                       "passage store's change log")
    hnsw_m: int = Field(32, ge=4, le=256)
    hnsw_ef_search: int = Field(64, ge=1)
    ivf_nlist: int = Field(0, ge=0, description="0 = about 4*sqrt(n) when trained")
    ivf_nprobe: int = Field(16, ge=1)
    ivf_min_train: int = Field(20_000, ge=64, description="ivf stays exact flat until this many vectors")

    _empty = field_validator("reranker", mode="before")(empty_is_none)

    @field_validator("reranker")
    @classmethod
    def _local_folder(cls, v: Path | None) -> Path | None:
        if v is not None and not v.expanduser().is_dir():
            raise ValueError(f"must be a local CrossEncoder model folder ({v} is not a folder; nothing is downloaded)")
        return v


class IngestSettings(Group):
    """Turning documents into passages, vectors and precomputed KV."""

    chunk_tokens: int = Field(256, ge=16, le=4096, description="model tokens per passage at most")
    batch_size: int = Field(32, ge=1, le=4096, description="passages per SQLite transaction / index save")
    embed_batch_size: int = Field(64, ge=1, le=4096)
    precompute_batch: int | None = Field(
        None, ge=1, le=1024, description="passages per KV precompute forward during ingestion (at most "
                                         "batch_size); unset = 16 on a GPU, 1 (one at a time) on the CPU")
    sample_corpus: Path | None = Field(SAMPLE_CORPUS, description="JSONL ingested on a first start")
    sample_on_start: bool = Field(True, description="ingest sample_corpus when the passage store is empty")

    _empty = field_validator("precompute_batch", mode="before")(empty_is_none)


class ServiceGroup(Group):
    """The HTTP listener and its request threads."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    max_queue: int = Field(16, ge=1, description="requests waiting for the engine's batch beyond its free "
                                                  "places before 503 (and blocking jobs waiting for a worker "
                                                  "thread)")
    workers: int | None = Field(None, ge=1, le=256, description="threads for blocking jobs (document "
                                "ingestion, store verification; queries await the engine loop); unset = 2")
    request_timeout_s: float = Field(120.0, gt=0)
    query_threads: int = Field(2, ge=1, le=64, description="threads that retrieve, rerank and plan queries "
                               "before the engine gets them (more wait their turn, counted in retrieval_ms)")
    query_nice: int = Field(19, ge=0, le=19, description="how much lower those threads' CPU priority is than the "
                            "engine loop's (a Linux nice increment): streams keep their pace while new questions "
                            "are retrieved and reranked; 0 = the same priority")
    query_idle: bool = Field(True, description="those threads run only on CPU the engine leaves idle (Linux "
                             "SCHED_IDLE: the engine's threads preempt them at once, steadier streams; the "
                             "engine's background work, storing missed passages, waits while they run); "
                             "false = niced by query_nice")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    _empty = field_validator("workers", mode="before")(empty_is_none)


class DecoderSettings(Group):
    """Who decodes a query's answer: Blendserve's own engine, or a stock vLLM server that loads the
    prompt's blended KV through Blendserve's KV connector (`blendserve_vllm`)."""

    kind: Literal["own", "vllm"] = Field(
        "own", description="own = Blendserve's engine prefills and decodes; vllm = Blendserve retrieves and blends "
                           "(prefill only), hands the KV over in shared memory, and the vLLM server at vllm_url "
                           "decodes (it must load blendserve_vllm.connector: docs/deployment.md)")
    vllm_url: str | None = Field(None, description="the vLLM server's base URL (http://host:port); required with "
                                                   "kind=vllm")
    vllm_model: str | None = Field(None, description="the model name the vLLM server serves; unset = the first "
                                                     "one its /v1/models lists")
    handover: Literal["shm", "redis"] = Field(
        "shm", description="how the blended KV reaches vLLM: shm = a segment file in segment_dir (vLLM on this "
                           "host, the same user); redis = a key in the Redis at handover_redis_url (vLLM on another "
                           "host; its connector's redis_url names the same Redis)")
    segment_dir: Path = Field(Path("/dev/shm"), description="the shared-memory folder segments are handed over "
                                                            "in (the connector's segment_dir: the same folder)")
    handover_redis_url: str | None = Field(None, description="redis://[:password@]host:port/db for handover=redis "
                                                             "(unset: BLENDSERVE_STORE_REDIS_URL)")
    handover_mb: int = Field(2048, ge=1, description="segments waiting for vLLM to load them, at most (the oldest "
                                                     "freed first)")
    handover_ttl_s: float = Field(120.0, gt=0, description="a segment vLLM has not loaded by then is freed")

    _empty = field_validator("vllm_url", "vllm_model", "handover_redis_url", mode="before")(empty_is_none)

    @model_validator(mode="after")
    def _url_for_vllm(self) -> DecoderSettings:
        if self.kind == "vllm" and not self.vllm_url:
            raise ValueError("BLENDSERVE_DECODER_KIND=vllm needs BLENDSERVE_DECODER_VLLM_URL (the vLLM server's "
                             "base URL, e.g. http://127.0.0.1:8001)")
        if self.vllm_url is not None and not self.vllm_url.startswith(("http://", "https://")):
            raise ValueError(f"BLENDSERVE_DECODER_VLLM_URL must start with http:// or https://, got {self.vllm_url!r}")
        return self


class LimitsSettings(Group):
    """What one request may ask for (over a limit: 413 or 422)."""

    max_body_bytes: int = Field(4 << 20, ge=1024, description="request bodies above this get 413")
    max_question_chars: int = Field(4000, ge=1)
    max_documents: int = Field(32, ge=1, description="documents per request (inline or ingested)")
    max_document_chars: int = Field(100_000, ge=1)
    max_title_chars: int = Field(300, ge=1, description="document titles above this get 422 (a title is repeated "
                                                        "in every passage of its document)")
    max_upload_mb: int = Field(50, ge=1, le=4096, description="largest file POST /v1/documents/upload takes (413)")
    max_upload_files: int = Field(20, ge=1, le=1000, description="files per upload request")
    max_new_tokens: int = Field(1024, ge=1, description="upper bound for a request's max_tokens")
    source_text_chars: int | None = Field(None, ge=1, description="an answer's sources carry each cited passage's "
                                                                  "text cut to this many characters; unset = whole")
    max_top_k: int = Field(50, ge=1)
    explain_max_tokens: int = Field(4096, ge=1, description="tokens explained per request (explain=true); "
                                                            "the rest are counted but not listed")

    @property
    def max_upload_body_bytes(self) -> int:
        """The upload route's body limit: every file at its limit, plus room for the multipart framing."""
        return self.max_upload_files * (self.max_upload_mb << 20) + (1 << 20)


class AuthSettings(Group):
    """Bearer keys: one shared key and per-tenant keys (each tenant gets its own KV namespace)."""

    api_key: str | None = Field(None, description="the shared bearer key; unset (and no tenant keys) = open")
    tenant_keys: dict[str, str] = Field({}, description="JSON {tenant: key}: each tenant's bearer key; its requests "
                                                        "get a KV cache namespace of their own")

    _empty = field_validator("api_key", mode="before")(empty_is_none)

    @field_validator("api_key")
    @classmethod
    def _ascii_key(cls, v: str | None) -> str | None:
        """HTTP headers arrive as latin-1 bytes: a key outside printable ASCII could never match."""
        if v is not None and not _printable_ascii(v):
            raise ValueError("must be printable ASCII without spaces (an HTTP Authorization header cannot carry "
                             "other characters reliably, so such a key could never match)")
        return v

    @field_validator("tenant_keys")
    @classmethod
    def _tenant_keys(cls, v: dict[str, str]) -> dict[str, str]:
        for tenant, key in v.items():
            if not tenant.strip() or not _printable_ascii(key):
                raise ValueError(f"tenant {tenant!r}: names must not be blank and keys must be printable ASCII "
                                 f"without spaces")
        if len(set(v.values())) != len(v):
            raise ValueError("two tenants share a key: each tenant needs its own")
        return v

    @model_validator(mode="after")
    def _api_key_is_no_tenant_key(self) -> AuthSettings:
        if self.api_key is not None and self.api_key in self.tenant_keys.values():
            raise ValueError("BLENDSERVE_AUTH_API_KEY is also a tenant's key: the shared key must differ from every "
                             "BLENDSERVE_AUTH_TENANT_KEYS key")
        return self


def _printable_ascii(key: str) -> bool:
    return bool(key) and all(0x21 <= ord(ch) <= 0x7E for ch in key)


SHARED_GROUPS: dict[str, type[Group]] = {"model": ModelSettings, "engine": EngineSettings, "store": StoreSettings,
                                         "retrieval": RetrievalSettings, "ingest": IngestSettings}
SERVICE_GROUPS: dict[str, type[Group]] = {"service": ServiceGroup, "limits": LimitsSettings, "auth": AuthSettings,
                                          "decoder": DecoderSettings}
ALL_GROUPS: dict[str, type[Group]] = {**SHARED_GROUPS, **SERVICE_GROUPS}
