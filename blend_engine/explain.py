"""What a prefill chose, per token, for the people looking at it (`BlendPlan.explain`).

Recording is opt-in and costs nothing when off. When on, the selection step keeps a reference
to its check-layer scores (device tensors, no host sync inside the layer loop); after the loop
they are copied to the host once and turned into one `SegmentExplanation` per prompt segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend_engine.kv_store import KVStore
from blend_engine.layout import PromptLayout


@dataclass(frozen=True)
class SegmentExplanation:
    """One prompt segment. Per-token tuples are aligned with `token_ids`.

    - recomputed: the token is in the final recomputed set (the set the last layers ran on;
      the same set `BlendReport.recomputed_positions` lists);
    - scores: the number that ranked the token at the check layer (blend only; None for tokens
      that did not compete: the system prefix, the question, passages that missed the cache);
    - cache: "hit" (KV loaded), "miss" (not cached, or found corrupt while loading: recomputed),
      or "off" (this mode loads nothing, or the segment is never cached: the question);
    - tier: the store tier that held the chunk when the request began (hits only).
    """

    kind: str  # "sys" | "passage" | "question"
    token_ids: tuple[int, ...]
    recomputed: tuple[bool, ...]
    scores: tuple[float | None, ...]
    cache: str
    tier: str | None

    @property
    def recomputed_tokens(self) -> int:
        return sum(self.recomputed)


@dataclass(frozen=True)
class Explanation:
    """Every segment in prompt order: `| sys | passage_1 .. passage_k | question |`.

    The recomputed flags of all segments add up to `BlendReport.recomputed_tokens`.
    """

    check_layer: int | None  # blend's check layer; None in modes that rank nothing
    metric: str  # how scores were computed, e.g. "k deviation x question attention"
    segments: tuple[SegmentExplanation, ...]

    @property
    def recomputed_tokens(self) -> int:
        return sum(s.recomputed_tokens for s in self.segments)


class ScoreProbe:
    """Holds the check layer's (positions [P], scores [P]) as device tensors until the loop ends."""

    def __init__(self) -> None:
        self._check: tuple[torch.Tensor, torch.Tensor] | None = None

    def record(self, positions: torch.Tensor, scores: torch.Tensor) -> None:
        if self._check is None:  # the check layer's ranking; later narrowing layers are not recorded
            self._check = (positions, scores)

    def to_host(self) -> dict[int, float]:
        """Absolute position -> score, in one device-to-host copy."""
        if self._check is None:
            return {}
        pos, score = self._check
        both = torch.stack([pos.to(torch.float64), score.to(torch.float64)]).cpu()  # [2, P]
        return {int(p): float(s) for p, s in zip(both[0].tolist(), both[1].tolist())}


def tier_of(store: KVStore, key: str) -> str | None:
    """The first tier holding `key` (a tiered store's top-down order), or the store's own name."""
    return store.tier_holding(key)


def build_explanation(layout: PromptLayout, final: Sequence[int], scores: dict[int, float],
                      cache: Sequence[tuple[str, str | None]], check_layer: int | None,
                      metric: str) -> Explanation:
    """cache[i]: (status, tier) of segment i; final: the recomputed positions."""
    chosen = set(final)
    segments = []
    for seg, (status, tier) in zip(layout.segments, cache):
        span = range(seg.offset, seg.end)
        segments.append(SegmentExplanation(
            kind=seg.kind, token_ids=seg.token_ids,
            recomputed=tuple(p in chosen for p in span),
            scores=tuple(scores.get(p) for p in span),
            cache=status, tier=tier,
        ))
    return Explanation(check_layer=check_layer, metric=metric, segments=tuple(segments))


def token_pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's text, such that the pieces joined give the decoded text.

    Decoded with one token of left context (SentencePiece drops a leading space on a token
    decoded alone); a token ending inside a multi-byte character gets "" and the character
    goes to the token that completes it.
    """
    pieces: list[str] = []
    start = 0  # first token whose text is not yet emitted
    for i in range(len(ids)):
        ctx = max(0, start - 1)
        base = tokenizer.decode(list(ids[ctx:start]), skip_special_tokens=False) if start > ctx else ""
        text = tokenizer.decode(list(ids[ctx:i + 1]), skip_special_tokens=False)
        if text.endswith("\ufffd") and i + 1 < len(ids) and i - start < 3:
            pieces.append("")
            continue
        pieces.append(text[len(base):] if text.startswith(base) else text)
        start = i + 1
    return pieces
