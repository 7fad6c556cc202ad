"""The oracle bound of issue #28: selections made with knowledge of the full prefill, run through
the layer loop's research seam (`executor.layers.LayerHooks`); the serving path never imports it.

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

import torch

from blend_engine.executor.layers import KVCache, LayerHooks, LayerJob
from blend_engine.executor.selection import RankSpace

ORACLE_MODES = ("select", "fix")


@dataclass(frozen=True)
class Oracle(LayerHooks):
    """Which competing positions an oracle run recomputes ("select") or substitutes ("fix"); pass it
    as `hooks` to `BlendEngine.prefill`."""

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

    def narrowing(self, default: dict[int, float], check_layer: int, blend: bool) -> dict[int, float]:
        """"select": made at the check layer, then never narrowed, or narrowed at its own schedule."""
        if self.mode != "select":
            return default
        if not blend:
            raise ValueError("an oracle selection needs a blend (a check layer)")
        steps = {layer: 1.0 for layer, _ in self.schedule} or {check_layer: 1.0}
        if min(steps) != check_layer:
            raise ValueError("an oracle schedule starts at the check layer")
        return steps

    def placed(self, layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
        if self.mode == "fix":
            self.substitute(layer, K, V)  # the chosen positions take the full prefill's K/V

    def select(self, layer: int, ranked: RankSpace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               K: torch.Tensor, V: torch.Tensor, job: LayerJob, current: torch.Tensor | None,
               multiplier: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode != "select":
            return super().select(layer, ranked, q, k, v, K, V, job, current, multiplier)
        picked = ranked.fixed(self.chosen(layer))  # [S]: within `current`, counts never grow
        return picked, (picked if current is None else torch.searchsorted(current, picked))  # rows [S]

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
