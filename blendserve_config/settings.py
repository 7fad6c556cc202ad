"""Configuration shared by the service and the batch CLI: `BLENDSERVE_*` variables and `.env`.

Bad values fail fast at start-up with pydantic's message naming the field. The fields only the
HTTP service reads (listener, API key, queue, timeout, request limits) are in
`app.settings.ServiceSettings`, a subclass reading the same variables and `.env`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from blend_engine.types import Mode
from retrieval import lexical

SAMPLE_CORPUS = Path(__file__).resolve().parent.parent / "sample_corpus" / "hotpotqa_sample.jsonl"


def empty_is_none(v):
    """An optional setting given as an empty or blank string (`BLENDSERVE_REDIS_URL=`) is unset."""
    return None if isinstance(v, str) and not v.strip() else v


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BLENDSERVE_", env_file=".env", extra="ignore")

    # storage
    data_dir: Path = Path("data")
    kv_format: Literal["auto", "fp16", "bf16", "fp32", "int8"] = Field(
        "auto", description="stored KV precision; auto = bf16 for a bf16 model on CUDA, else fp16")
    memory_cache_mb: int = Field(1024, ge=0)
    memory_cache_gb: float | None = Field(None, ge=0, description="memory tier budget in GB (2**30 bytes); when set "
                                                                  "it overrides memory_cache_mb")
    device_cache_gb: float | None = Field(None, ge=0, allow_inf_nan=False,
                                          description="device (GPU) hot tier above the memory tier, in GB (2**30 "
                                                      "bytes); unset = automatic: 0 off CUDA, 20% of the device "
                                                      "memory free after the model and the batch's KV on CUDA")
    disk_cache_mb: int = Field(20480, ge=0)
    disk_direct_io: bool = Field(False, description="layer streams read the disk tier with O_DIRECT (for drives where "
                                                    "the page cache only gets in the way)")
    prefix_cache_mb: int = Field(1024, ge=0, description="in-memory budget of prefix_cache mode's in-context "
                                                         "entries, per engine (LRU); 0 = never reuse a prefix")
    redis_url: str | None = None
    database_url: str | None = Field(None, description="postgresql://... = shared passage store; unset = SQLite "
                                                        "in data_dir")
    index_sync_interval_s: float = Field(0.5, gt=0, le=60, description="how often the FAISS index polls the "
                                                                       "passage store's change log")
    redis_timeout_s: float = Field(0.5, gt=0)
    # model and engine
    model: str = "smollm2-135m-instruct"
    # issue #38: where a GGUF model is prepared once (de-quantized into its run dtype); unset = ~/.cache/blendserve/models
    model_cache_dir: Path | None = Field(None, description="folder of prepared (de-quantized) GGUF models; unset = "
                                                           "~/.cache/blendserve/models")
    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    default_mode: Mode = Mode.BLEND
    recompute_ratio: float | None = Field(None, ge=0, le=1, description="fixed ratio; unset = controller")
    ratio_floor: float = Field(0.15, ge=0, le=1)
    ratio_max: float = Field(0.5, ge=0, le=1)
    selected_attention: Literal["auto", "sdpa_mask", "flex"] = Field(
        "auto", description="how a blend's recomputed rows attend: auto = 4 blocks on the CPU, one boolean-mask "
                            "SDPA on a GPU; flex = FlexAttention (compiled on CUDA at first use)")
    max_batch: int = Field(8, ge=1, le=256, description="requests the engine loop prefills and decodes at once "
                                                        "(continuous batching); more wait in its queue")
    batch_kv_mb: int = Field(2048, ge=1, description="KV memory of the running batch (each request's prompt plus "
                                                     "max_tokens, in the model's dtype); requests past it wait")
    prefill_step_tokens: int = Field(4096, ge=1, description="while others decode, a prefill runs layers until they "
                                                             "computed this many tokens (summed over layers) per step")
    fidelity_gate: Literal["enforce", "warn", "off"] = Field(
        "enforce", description="start-up fidelity check: enforce = blend falls back to full prefill when it fails")
    # retrieval and ingestion
    embedder: str = Field("", description="sentence-transformers directory; empty = bundled all-MiniLM-L6-v2")
    index_type: Literal["flat", "hnsw", "ivf"] = "flat"
    chunk_tokens: int = Field(256, ge=16, le=4096)
    top_k: int = Field(5, ge=1, le=50)
    placement: Literal["score", "best_last"] = "best_last"
    retrieval: Literal["dense", "lexical", "hybrid"] = Field(
        "hybrid", description="dense = embeddings (FAISS); lexical = full-text search in the passage store (SQLite "
                              "FTS5 / PostgreSQL); hybrid = both, fused (hybrid_fusion); a request may override it")
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
    sample_corpus: Path | None = SAMPLE_CORPUS
    ingest_sample_on_start: bool = True
    ingest_batch_size: int = Field(32, ge=1, le=4096, description="passages per SQLite transaction / index save")
    embed_batch_size: int = Field(64, ge=1, le=4096)
    precompute_batch: int | None = Field(
        None, ge=1, le=1024, description="passages per KV precompute forward during ingestion (at most "
                                         "ingest_batch_size); unset = 16 on a GPU, 1 (one at a time) on the CPU")
    hnsw_m: int = Field(32, ge=4, le=256)
    hnsw_ef_search: int = Field(64, ge=1)
    ivf_nlist: int = Field(0, ge=0, description="0 = about 4*sqrt(n) when trained")
    ivf_nprobe: int = Field(16, ge=1)
    ivf_min_train: int = Field(20_000, ge=64, description="ivf stays exact flat until this many vectors")

    _empty_is_none = field_validator("redis_url", "database_url", "precompute_batch", "reranker", "memory_cache_gb",
                                     "device_cache_gb", "model_cache_dir",
                                     mode="before")(empty_is_none)

    @field_validator("reranker")
    @classmethod
    def _local_folder(cls, v: Path | None) -> Path | None:
        if v is not None and not v.expanduser().is_dir():
            raise ValueError(f"must be a local CrossEncoder model folder ({v} is not a folder; nothing is downloaded)")
        return v

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (unset = SQLite in the data dir)")
        return v

    @model_validator(mode="after")
    def _ratio_bounds(self) -> Settings:
        if self.ratio_floor > self.ratio_max:
            raise ValueError("ratio_floor must not exceed ratio_max")
        return self

    @property
    def memory_cache_bytes(self) -> int:
        """The memory tier's budget: BLENDSERVE_MEMORY_CACHE_GB when set, else BLENDSERVE_MEMORY_CACHE_MB."""
        if self.memory_cache_gb is not None:
            return int(self.memory_cache_gb * (1 << 30))
        return self.memory_cache_mb << 20

    @property
    def kv_dir(self) -> Path:
        return self.data_dir / "kv"
