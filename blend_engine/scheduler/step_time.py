"""The prefill work a step may carry while others decode, from a time target: the engine's own steps
teach it what a unit of prefill work costs here. Torch-free.

    a decode-only step           | decode rows |                       d  (moving average)
    a step carrying prefill      | decode rows | prefill work: u units |  t
                                                 seconds a unit ~ (t - d) / u  (moving average)
    next step's budget            target_s / (seconds a unit), within [1, the token budget]

A unit is `batch.PrefillBudget`'s: a prefill row through one layer, plus each layer's fixed
overhead and the cached-prefix copies of admissions (`batch.BatchLimits`). What a unit costs
depends on the hardware, the model and the contexts attended over (on 2 CPU cores, SmolLM2-135M,
a repeat's 13 rows over a 780-token prefix cost ~4x what the rows alone suggest), so it is
measured rather than assumed: the decode rows' tokens then wait about `target_s` more for a step
that carries prefill work, whatever the machine. Until a step carrying prefill has been measured,
the budget is `PROBE_UNITS`: a small first step to learn from (at the token budget a fresh service's
first prefill beside a stream ran 1,290 units, an 86 ms step where the target gives ~45 ms).
"""

from __future__ import annotations

from blend_engine.scheduler.admission import moving_average

ALPHA = 0.2  # weight of the newest step in the moving averages
MIN_UNITS_MEASURED = 16  # a step with less prefill work than this teaches nothing (noise over little work)
PROBE_UNITS = 128  # the budget until a step carrying prefill work has been measured


class StepTime:
    """Learns seconds per unit of prefill work; `units(cap)` is the next step's prefill budget.
    `target_s` None: no time target (the token budget alone)."""

    def __init__(self, target_s: float | None) -> None:
        if target_s is not None and target_s <= 0:
            raise ValueError("a step's prefill time target must be > 0 seconds")
        self.target_s = target_s
        self.decode_s: float | None = None  # moving average of decode-only steps
        self.unit_s: float | None = None  # moving average of seconds per unit of prefill work

    def decode_step(self, seconds: float) -> None:
        """A step that ran decode rows only took `seconds`."""
        self.decode_s = moving_average(self.decode_s, seconds, ALPHA)

    def prefill_step(self, seconds: float, units: int) -> None:
        """A step that ran decode rows and `units` of prefill work took `seconds`."""
        if self.decode_s is None or units < MIN_UNITS_MEASURED:
            return
        self.unit_s = moving_average(self.unit_s, max(seconds - self.decode_s, 0.0) / units, ALPHA)

    def units(self, cap: int) -> int:
        """The next step's prefill budget: what `target_s` buys at the measured cost, at most `cap`
        (the token budget) and at least 1 (the oldest prefill still advances a layer a step);
        `PROBE_UNITS` until that cost was measured."""
        if self.target_s is None:
            return cap
        if not self.unit_s:
            return min(cap, PROBE_UNITS)
        return max(1, min(cap, int(self.target_s / self.unit_s)))
