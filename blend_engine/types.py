"""Frozen dataclasses at the engine's boundary. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blend_engine.explain import Explanation

from blend_engine.errors import InputError


class Mode(str, Enum):
    BLEND = "blend"
    FULL_PREFILL = "full_prefill"
    PREFIX_CACHE = "prefix_cache"
    FULL_REUSE = "full_reuse"

    @classmethod
    def parse(cls, value: str | Mode) -> Mode:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown mode {value!r}; expected one of {[m.value for m in cls]}") from None


ALLOCATIONS = ("global", "length", "attention")


@dataclass(frozen=True)
class SelectionPolicy:
    """Which tokens are recomputed after the check layer.

    - check_layer: the layer whose fresh K/V are compared to the cache (every layer up to and
      including it is recomputed for all tokens). Layer 0 measures nothing: its K/V depend
      only on token and position.
    - metric: "k", "v" or "kv" deviation between fresh and cached values.
    - check_multiplier: at the check layer keep ratio x multiplier of the passage tokens.
    - schedule: gradual filtering, ((layer, multiplier), ...) with increasing layers: at each
      listed layer the current set is narrowed to ratio x multiplier by that layer's deviation.
    - sink_tokens: EPIC-style, always recompute the first k tokens of every passage.
    - end_tokens: EPIC's other boundary, always recompute the last k tokens of every passage
      (after its sinks: a passage shorter than both loses end tokens, not sinks).
    - ape_temperature, ape_scale: APE (Yang et al., ICLR 2025): the question's tokens attend to
      the cached passages' keys as one block whose logits are divided by the temperature (< 1
      sharpens), and whose share of the attention is multiplied by the scale (its log-sum-exp
      x temperature, + log scale, against the system prefix's and the question's own). 1 and 1
      are plain attention. Applied to the question's rows in the prefill (so to the first token;
      decoding attends plainly).
    - use_deviation: False gives pure EPIC (only sinks, plus uncached tokens).
    - query_weighted: weight each token's deviation by the attention the question's tokens pay
      it at that layer, so stale tokens nobody reads are not recomputed (computed from the
      fresh queries of the question, which every layer recomputes anyway).
    - query_mass: "layer" weights by the attention at the selecting layer alone; "running" by
      its mean over every selecting layer so far (the check layer and the schedule's).
    - allocation: how the recompute budget is shared between passages. "global": one top-k over
      every passage token; "length": each passage keeps ratio x its own tokens; "attention": each
      passage keeps a share of the budget proportional to the attention the question pays it
      (at the selecting layer). Either way the total kept is the same as "global"'s; a passage
      with fewer candidates than its share leaves the rest to the others.

    `SelectionPolicy()` is the serving default, spelled once by the field defaults: K deviation at
    layer 1, weighted by the attention the question pays each token, keeping 4x the ratio, narrowed
    to 2x, 1.5x and 1x of it at layers 2, 3 and 4 (gradual filtering); no sinks. Chosen by comparing
    variants on short dev paragraphs and kept after issue #28's length sweep (`python -m benchmarks.ttft.engine
    --lengths 0,200,400,600`, docs/results-archive.md): the sweep's best worst cases add 8 EPIC sink tokens
    per passage (tune-half worst KL ratio 0.310x against 0.353x, 3 questions a cell), but the sinks
    force the first 8 tokens of every cached segment (+4.6% TTFT at 4K, and most of a chat prompt
    of short turns). The variants compared live in `benchmarks/common/policies.py`.
    """

    check_layer: int = 1
    metric: str = "k"
    check_multiplier: float = 4.0
    schedule: tuple[tuple[int, float], ...] = ((2, 2.0), (3, 1.5), (4, 1.0))
    sink_tokens: int = 0
    use_deviation: bool = True
    query_weighted: bool = True
    query_mass: str = "layer"
    allocation: str = "global"
    end_tokens: int = 0
    ape_temperature: float = 1.0
    ape_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.metric not in ("k", "v", "kv"):
            raise ValueError(f"metric must be 'k', 'v' or 'kv', not {self.metric!r}")
        if self.query_mass not in ("layer", "running"):
            raise ValueError(f"query_mass must be 'layer' or 'running', not {self.query_mass!r}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, not {self.allocation!r}")
        if self.check_layer < 0:
            raise ValueError("check_layer must be >= 0")
        if self.sink_tokens < 0 or self.end_tokens < 0:
            raise ValueError("sink_tokens and end_tokens must be >= 0")
        if not (self.ape_temperature > 0 and self.ape_scale > 0):
            raise ValueError("ape_temperature and ape_scale must be > 0")
        layers = [lay for lay, _ in self.schedule]
        if layers != sorted(layers) or any(lay <= self.check_layer for lay in layers):
            raise ValueError("schedule layers must increase and come after the check layer")


def default_policy() -> SelectionPolicy:
    """`SelectionPolicy()`: a factory for `dataclasses.field(default_factory=...)` users."""
    return SelectionPolicy()


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class GenerationConfig:
    """Per-request sampling: each request in a batch keeps its own."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None: off; k: each token's logprob and the k most likely alternatives
    ignore_eos: bool = False  # decode through end-of-sequence up to max_tokens (benchmarks, as vLLM's)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InputError("max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InputError(f"logprobs must be within [0, {MAX_TOP_LOGPROBS}]")
        if self.temperature < 0:
            raise InputError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InputError("top_p must be in (0, 1]")


@dataclass(frozen=True)
class Turn:
    """An earlier message of a conversation: role "user" or "assistant", and its text."""

    role: str
    text: str

    def __post_init__(self) -> None:
        if self.role not in ("user", "assistant"):
            raise InputError(f"a conversation turn's role must be 'user' or 'assistant', not {self.role!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise InputError("a conversation turn needs text")


@dataclass(frozen=True)
class BlendPlan:
    """What to prefill: `| sys | passage_1 .. passage_k | turn_1 .. turn_m | question |` and how.

    recompute_ratio None means: let the engine's controller (or its default) choose. `turns` are the
    conversation's earlier messages, oldest first (the question is the latest user message);
    `numbered` puts a `[n]` marker before passage n so that the model can cite it (`layout`).
    """

    passages: tuple[str, ...]
    question: str
    mode: Mode = Mode.BLEND
    recompute_ratio: float | None = None
    system_prompt: str | None = None
    policy: SelectionPolicy | None = None
    explain: bool = False  # record per-token choices (`BlendResult.explanation`); off costs nothing
    turns: tuple[Turn, ...] = ()
    numbered: bool = False
    cache_salt: str | None = None  # enters every chunk key: another tenant's cached KV is never reused

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        object.__setattr__(self, "passages", tuple(self.passages))
        object.__setattr__(self, "turns", tuple(self.turns))
        if not self.passages:
            raise InputError("a blend plan needs at least one passage")
        if any(not isinstance(p, str) or not p.strip() for p in self.passages):
            raise InputError("passages must be non-empty strings")
        if not isinstance(self.question, str) or not self.question.strip():
            raise InputError("question must be a non-empty string")
        r = self.recompute_ratio
        if r is not None and not (0.0 <= r <= 1.0):
            raise InputError(f"recompute_ratio must be within [0, 1], got {r}")


@dataclass(frozen=True)
class BlendReport:
    """What one prefill did. Times in milliseconds."""

    mode: str
    recompute_ratio: float
    ratio_source: str  # "request", "default", "controller", "mode"
    context_tokens: int
    recomputed_tokens: int
    recomputed_positions: tuple[int, ...]
    selected_per_layer: tuple[int, ...]
    cache_hits: int
    cache_misses: int
    prefix_tokens_reused: int
    repaired_chunks: int
    assemble_ms: float
    recompute_ms: float
    load_ms: float
    load_wait_ms: float
    prefill_ms: float
    layer_load_ms: tuple[float, ...] = ()  # per layer: the reader's time on it (loader's LoadTrace.read_s)
    layer_compute_ms: tuple[float, ...] = ()
    layer_wait_ms: tuple[float, ...] = ()  # per layer: how long compute blocked for its load (LoadTrace.wait_s)

    @property
    def load_hidden_ms(self) -> float:
        return max(0.0, self.load_ms - self.load_wait_ms)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token, its log probability and the most likely alternatives (text, logprob)."""

    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class BlendResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length"
    report: BlendReport
    ttft_ms: float
    total_ms: float  # prefill and decoding: the answer is complete
    store_ms: float  # after the answer: storing the KV of passages that missed the cache
    explanation: Explanation | None = None  # per-token choices, when the plan asked (`explain`)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per generated token, when `GenerationConfig.logprobs` is set
    queue_ms: float = 0.0  # submitted until admitted to the batch (part of ttft_ms)
