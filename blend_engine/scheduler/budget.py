"""How many tokens each layer of a blend prefill keeps: the one rule the selection (which runs it)
and the ratio controller (which predicts it) share.

    | sys | chunk_1 .. chunk_k | question |
      exact   compete             forced (always recomputed)

Layers up to and including the check layer compute every token. At the check layer the selection
keeps the forced tokens (uncached: the question, chunks that missed the cache, EPIC sinks) plus
`kept(n_compete, ratio, check_multiplier)` competitors, and each of the schedule's layers narrows
that to `kept(n_compete, ratio, multiplier)`. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from blend_engine.types import SelectionPolicy


def kept(n_compete: int, ratio: float, multiplier: float = 1.0) -> int:
    """Competitors kept at `ratio` x `multiplier` of `n_compete`: rounded up, at most all of them."""
    return max(0, min(n_compete, math.ceil(ratio * multiplier * n_compete - 1e-9)))


def narrowing(policy: SelectionPolicy) -> dict[int, float]:
    """layer -> multiplier at the layers where the selection is made or narrowed (check, schedule)."""
    return {policy.check_layer: policy.check_multiplier, **dict(policy.schedule)}


@dataclass(frozen=True)
class PrefillWork:
    """What one blend prefill has to do, known before it starts (from the layout and cache lookups)."""

    n_tokens: int  # N: the whole prompt
    n_cached: int  # P: competitors (cached chunk tokens, sinks excluded)
    n_forced: int  # tokens always recomputed above the check layer (uncached, sinks)
    n_layers: int
    bytes_per_layer: int  # bytes loaded per layer (hits only)
    policy: SelectionPolicy = SelectionPolicy()

    def tokens_per_layer(self, ratio: float) -> list[int]:
        """Tokens computed at each layer at this ratio, as the selection keeps them."""
        steps, mult, out = narrowing(self.policy), None, []
        for layer in range(self.n_layers):
            mult = steps.get(layer, mult)
            out.append(self.n_tokens if layer <= self.policy.check_layer
                       else self.n_forced + kept(self.n_cached, ratio, mult))
        return out
