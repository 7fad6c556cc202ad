"""The oracle bound of issue #28: selections made with knowledge of the full prefill. A debug seam
for `benchmarks.oracle`; a serving request never carries one (`LayerJob.oracle` is None, and the
layer loop's only cost then is one `is None` test per layer and at the check layer).

    | sys | passage_1 .. passage_k | question |
      exact   compete: ranked by their TRUE   forced, as in a blend
              deviation from the full prefill

- "select": a blend whose selection at the check layer is exactly `positions` plus the forced
  positions (the question, uncached tokens), never narrowed: those are recomputed at every later
  layer, attending over the blended cache (the best a deviation-ranked selection can do). With a
  `schedule` (layer -> count; the check layer first, counts not growing) `positions` are in rank
  order, best first, and each listed layer keeps the first `count` of them (the default policy's
  gradual narrowing, ranked by the oracle).
- "fix": after each layer's cached K/V are placed, `positions` take the full prefill's K/V of that
  layer (`exact`); run as full_reuse, the question is then prefilled over that cache (a bound for any
  method that corrects that many tokens and keeps the rest cached).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from blend_engine.executor.layers import KVCache

ORACLE_MODES = ("select", "fix")


@dataclass(frozen=True)
class Oracle:
    """Which competing positions an oracle run recomputes ("select") or substitutes ("fix")."""

    mode: str
    positions: torch.Tensor  # [R] competing (cached passage) positions (in rank order with a schedule)
    exact: KVCache | None = None  # "fix": the full prefill's cache of the same prompt
    schedule: tuple[tuple[int, int], ...] = ()  # "select": ((layer, count), ...); () = all from the check layer

    def __post_init__(self) -> None:
        if self.mode not in ORACLE_MODES:
            raise ValueError(f"oracle mode must be one of {ORACLE_MODES}, not {self.mode!r}")
        if self.mode == "fix" and self.exact is None:
            raise ValueError("an oracle 'fix' needs the full prefill's cache (exact)")
        layers, counts = [lay for lay, _ in self.schedule], [c for _, c in self.schedule]
        if layers != sorted(set(layers)) or counts != sorted(counts, reverse=True) or any(
                not 0 <= c <= self.positions.shape[0] for c in counts):
            raise ValueError("an oracle schedule's layers must increase and its counts must not grow")

    def chosen(self, layer: int) -> torch.Tensor:
        """"select": the competing positions kept from this layer on [R'] (all without a schedule)."""
        return self.positions if not self.schedule else self.positions[:dict(self.schedule)[layer]]

    def substitute(self, layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
        """"fix": the chosen positions of K, V [H, C, D] take the exact K/V of this layer."""
        p = self.positions
        K[:, p] = self.exact.k[layer][:, p].to(K.dtype)  # [H, R, D]
        V[:, p] = self.exact.v[layer][:, p].to(V.dtype)  # [H, R, D]


def true_deviation(full: KVCache, blended: KVCache, positions: torch.Tensor, first_layer: int = 1,
                   weights: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Per position in `positions` [P]: its K/V deviation between the blended cache (cached K/V
    placed by RoPE, nothing recomputed: full_reuse's cache) and the full prefill's, over every layer
    from `first_layer` on: [P].

    Per layer, the squared L2 distance of K and of V (summed over heads and head dims) are each
    divided by their mean over `positions`, so that every layer, and K and V, weigh the same
    whatever their scale; the layers' terms are summed (`weights`: per layer [P] factors, e.g. the
    question's attention to each position, applied to that layer's term). Layer 0 is left out by
    default: its K/V depend only on token and position, so its deviation is the storage rounding."""
    total = torch.zeros(positions.shape[0], dtype=torch.float32, device=positions.device)  # [P]
    for layer in range(first_layer, len(full.k)):
        term = torch.zeros_like(total)  # [P]
        for exact, cached in ((full.k[layer], blended.k[layer]), (full.v[layer], blended.v[layer])):
            d = (exact[:, positions].float() - cached[:, positions].float()).pow(2).sum(dim=(0, 2))  # [P]
            term += d / d.mean().clamp_min(1e-12)
        total += term if weights is None else term * weights[layer]
    return total


def top_positions(score: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` positions of `positions` [P] with the highest `score` [P], sorted: [count]."""
    if not 0 <= count <= positions.shape[0]:
        raise ValueError(f"cannot keep {count} of {positions.shape[0]} positions")
    return positions[torch.topk(score, count).indices].sort().values  # [count]


__all__ = ["ORACLE_MODES", "Oracle", "top_positions", "true_deviation"]
