"""Selection policies the benchmarks compare against the serving default (`SelectionPolicy()`).

The serving code never imports this module: the previous defaults and the ablation's building
block live here, spelled out field by field so that a later change of the default does not move
them.
"""

from __future__ import annotations

from blend_engine.types import SelectionPolicy

# The default chosen before issue #28 by ablation on short dev paragraphs (equal to today's
# `SelectionPolicy()`; kept explicit so the sweep's baseline stays put if the default moves).
PREVIOUS_DEFAULT = SelectionPolicy(check_layer=1, metric="k", check_multiplier=4.0,
                                   schedule=((2, 2.0), (3, 1.5), (4, 1.0)), sink_tokens=0, use_deviation=True,
                                   query_weighted=True, query_mass="layer", allocation="global", end_tokens=0,
                                   ape_temperature=1.0, ape_scale=1.0)

# One check at layer 1 on K and V, no narrowing, no question weighting, no sinks: what the
# ablation's variants change one thing at a time from.
_PLAIN = dict(check_layer=1, metric="kv", check_multiplier=1.0, schedule=(), sink_tokens=0, use_deviation=True,
              query_weighted=False, query_mass="layer", allocation="global", end_tokens=0, ape_temperature=1.0,
              ape_scale=1.0)


def plain(**changes: object) -> SelectionPolicy:
    """The plain single-check policy with `changes` applied (`plain(metric="v")` = LMCache-style)."""
    return SelectionPolicy(**{**_PLAIN, **changes})


def previous_default(**changes: object) -> SelectionPolicy:
    """The previous default with `changes` applied (issue #28's sweep varies one field at a time)."""
    return SelectionPolicy(**{**PREVIOUS_DEFAULT.__dict__, **changes})
