"""Continuous batching: which requests run in the next engine step. Torch-free; request ids only.

Each step of the engine loop:

    admit    the oldest waiting request, when no prefill is under way, the batch has room
             (`max_batch`) and its KV fits the memory budget (`kv_budget_bytes`; a request alone
             is always admitted, so one larger than the budget still runs, by itself)
    prefill  the admitted request's layers, until they computed `prefill_step_tokens` tokens
             (summed over layers, at least one layer) while others decode: a long prefill is cut
             into bounded steps and cannot stall the running decodes for long; with nothing
             decoding it runs whole
    decode   ONE batched decode step for every request past its prefill

A request leaves at its last token, or at the next step after it is cancelled or fails.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 8  # requests prefilling or decoding at once
    kv_budget_bytes: int = 2 << 30  # KV memory of the running requests (prompt + max new tokens)
    prefill_step_tokens: int = 4096  # a prefill's work per step while others decode (tokens x layers)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.kv_budget_bytes < 1:
            raise ValueError("kv_budget_bytes must be >= 1")
        if self.prefill_step_tokens < 1:
            raise ValueError("prefill_step_tokens must be >= 1")


@dataclass(frozen=True)
class StepPlan:
    """One engine step: requests to start, the one whose prefill advances (and its token budget;
    None: run it whole), and the ones that take a decode step."""

    admit: tuple[int, ...] = ()
    prefill: int | None = None
    prefill_tokens: int | None = None
    decode: tuple[int, ...] = ()

    @property
    def idle(self) -> bool:
        return not self.admit and self.prefill is None and not self.decode


class BatchScheduler:
    """Waiting queue, the prefilling request, the decoding batch and their KV bytes. The engine loop
    alone changes it; the introspection properties read plain ints (safe from a metrics scrape)."""

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self._waiting: deque[tuple[int, int]] = deque()  # (request id, KV bytes)
        self._kv: dict[int, int] = {}  # running request -> KV bytes
        self._kv_total = 0  # their sum, kept as an int: read from other threads without iterating
        self._prefilling: int | None = None
        self._decoding: list[int] = []

    # ------------------------------------------------------------------ state changes
    def add(self, rid: int, kv_bytes: int) -> None:
        self._waiting.append((rid, kv_bytes))

    def prefilled(self, rid: int) -> None:
        """`rid` finished its prefill: it decodes from the next step on."""
        if self._prefilling != rid:
            raise ValueError(f"request {rid} is not prefilling")
        self._prefilling = None
        self._decoding.append(rid)

    def finish(self, rid: int) -> None:
        """`rid` is done (last token, cancelled, failed), wherever it was: its KV budget is free."""
        self._waiting = deque((r, b) for r, b in self._waiting if r != rid)
        self._kv_total -= self._kv.pop(rid, 0)
        if self._prefilling == rid:
            self._prefilling = None
        if rid in self._decoding:
            self._decoding.remove(rid)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> StepPlan:
        admit = self._admit()
        busy = bool(self._decoding)
        return StepPlan(admit=admit, prefill=self._prefilling,
                        prefill_tokens=self.limits.prefill_step_tokens if busy else None,
                        decode=tuple(self._decoding))

    def _admit(self) -> tuple[int, ...]:
        if self._prefilling is not None or not self._waiting:
            return ()
        rid, need = self._waiting[0]
        running = len(self._kv)
        if running and (running >= self.limits.max_batch or self.kv_bytes + need > self.limits.kv_budget_bytes):
            return ()
        self._waiting.popleft()
        self._kv[rid] = need
        self._kv_total += need
        self._prefilling = rid
        return (rid,)

    # ------------------------------------------------------------------ introspection
    @property
    def kv_bytes(self) -> int:
        return self._kv_total

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._kv)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._kv)
