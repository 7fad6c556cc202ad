"""Generation: the caller's handle on one request that the engine loop prefills and decodes.

Iterate to receive text deltas as they are decoded (`deltas()` for deltas with their token
logprobs); `.result` once exhausted. Closing the iterator early (or `cancel()`) takes the request
out of the batch at the next step. Per-request state lives here and in the loop's request, never
on the engine.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blend_engine.cancel import Cancelled
from blend_engine.types import BlendPlan, BlendResult, GenerationConfig, TokenLogprob

if TYPE_CHECKING:
    from blend_engine.executor.layers import KVCache
    from blend_engine.executor.prefill import PrefillState


@dataclass(frozen=True)
class Delta:
    """New text (may be "" while a stop string or a UTF-8 sequence is pending) and the logprobs of
    the tokens it came from (empty unless `GenerationConfig.logprobs` is set)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


_END = object()


@dataclass(frozen=True)
class Ended:
    """The last item a sink receives for a generation that completed (`Generation.result`)."""

    result: BlendResult


class Generation:
    """One sequence's outputs, filled by the engine loop's thread (`emit`, `end`, `fail`): into its
    own queue, read by iterating it, or into a `sink` that a caller shares between the n sequences
    of one request (each item is a `Delta`, then `Ended` or the exception it failed with)."""

    def __init__(self, submit: Callable[[Generation], None] | None, plan: BlendPlan, gen: GenerationConfig,
                 sink: Callable[[object], None] | None = None) -> None:
        self._submit = submit
        self.plan, self.gen = plan, gen
        self._sink = sink
        self._items: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        self._started = False
        self.result: BlendResult | None = None
        self.state: PrefillState | None = None  # set by the loop when the prefill is done
        self.ttft_ms: float | None = None
        # called on the loop's thread once the prefill is done, while the request's run of the pool
        # holds its KV: export(cache, state) (the `vllm` decoder hands the KV over there)
        self.export: Callable[[KVCache, PrefillState], None] | None = None

    # ------------------------------------------------------------------ caller side
    def __iter__(self) -> Iterator[str]:
        deltas = self.deltas()
        try:
            for delta in deltas:
                if delta.text:
                    yield delta.text
        finally:
            deltas.close()  # closed early: the request leaves the batch at the next step

    def deltas(self) -> Iterator[Delta]:
        """Submit the request (on first use), then yield its deltas until it ends."""
        if self._started or self._submit is None:
            raise RuntimeError("a Generation can be iterated once, and one with a sink not at all")
        self._started = True
        self._submit(self)  # input errors (context overflow, ...) raise here, in the caller's thread
        try:
            while True:
                item = self._items.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if self.result is None:
                self.cancel()  # closed early: the loop drops it at its next step

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # ------------------------------------------------------------------ engine-loop side
    def emit(self, delta: Delta) -> None:
        self._put(delta)

    def end(self, result: BlendResult) -> None:
        self.result = result
        self._put(Ended(result) if self._sink is not None else _END)

    def fail(self, exc: BaseException) -> None:
        self._put(exc if isinstance(exc, BaseException) else Cancelled(str(exc)))

    def _put(self, item: object) -> None:
        (self._sink or self._items.put)(item)
