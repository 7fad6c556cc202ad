"""The async engine client: what a web process holds (vLLM's AsyncLLM, SGLang's TokenizerManager).

    event loop (the routes)                         engine loop thread
    -----------------------                         ------------------
    ticket = client.admit(timeout_s)                admission (`scheduler.admission`), first
    stream = client.submit(plan, gens, ticket=...)  then
      layout, keys, plan: host work, once      ->     batched prefill and decode steps
    async for index, delta in stream:          <-   deltas, put on the event loop's queue
    stream.abort()  (client gone)              ->   dropped at the next step

A request touches these two threads only, whatever its number of choices n: its n sequences are
planned and laid out once (`BlendEngine.start`) and their items arrive on one asyncio queue. The
stream carries its own abort; its deadline (`timeout_s`) is enforced by the engine loop (the
request fails with `cancel.DeadlineExceeded`) and, should the loop be busy past it, here too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from blend_engine.cancel import DeadlineExceeded
from blend_engine.generation import Delta, Ended, Generation
from blend_engine.layout import PromptLayout
from blend_engine.scheduler.admission import Ticket
from blend_engine.types import BlendPlan, BlendResult, GenerationConfig

__all__ = ["EngineClient", "RequestStream"]


class RequestStream:
    """One submitted request's n sequences, read on the event loop: iterate for `(index, Delta)`
    until every sequence ended, then `results`. A failed sequence raises its error (the others
    are aborted); leaving early needs `abort()` (the engine drops the request at its next step)."""

    def __init__(self, n: int, timeout_s: float | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._live = n
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.handles: list[Generation] = []
        self.results: list[BlendResult | None] = [None] * n

    # ------------------------------------------------------------------ engine-loop side
    def sink(self, index: int, item: object) -> None:
        """Sequence `index`'s next item (a Delta, Ended, or its error), from the engine loop's thread."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, (index, item))
        except RuntimeError:  # the event loop is closed: nobody reads this request any more
            self.abort()

    # ------------------------------------------------------------------ event-loop side
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        while self._live:
            index, item = await self._next()
            if isinstance(item, Ended):
                self.results[index] = item.result
                self._live -= 1
            elif isinstance(item, BaseException):
                self._live = 0
                self.abort()
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    async def _next(self) -> tuple[int, object]:
        if self._deadline is None:
            return await self._items.get()
        try:
            return await asyncio.wait_for(self._items.get(), max(0.0, self._deadline - time.monotonic()))
        except (TimeoutError, asyncio.TimeoutError):
            self.abort()
            raise DeadlineExceeded(f"request exceeded its timeout of {self.timeout_s:g} s") from None

    @property
    def done(self) -> bool:
        return self._live == 0

    def abort(self) -> None:
        """Stop every sequence at the engine's next step (a no-op for the ones that ended)."""
        for h in self.handles:
            h.cancel()


class EngineClient:
    """Submit a request, stream its deltas, abort it: the routes' only way to the engine loop."""

    def __init__(self, engine) -> None:
        self.engine = engine  # BlendEngine (duck-typed: `start`)

    def admit(self, timeout_s: float | None) -> Ticket:
        """A place in the engine's queue before the prompt is built (retrieval, layout), or
        `errors.Overloaded` at once: a refused request costs nothing more."""
        return self.engine.loop.admission.admit(timeout_s)

    def prepare(self, plan: BlendPlan, gens: Sequence[GenerationConfig], layout: PromptLayout) -> Any:
        """The engine's host work for `submit` (chunk keys, mode plan, block hashes), on any thread:
        the caller may run it off the event loop and pass it to `submit` as `prep`."""
        return self.engine.prepare(plan, max(g.max_tokens for g in gens), layout)

    def submit(self, plan: BlendPlan, gens: Sequence[GenerationConfig], timeout_s: float | None = None,
               layout: PromptLayout | None = None, ticket: Ticket | None = None,
               export: Callable[[Any, Any], None] | None = None, prep: Any = None) -> RequestStream:
        """Plan the request here (on the event loop: host work only) and queue its n sequences on
        `ticket` (`admit`; one is taken now when None). Raises `errors.InputError` (the prompt
        cannot be served as asked) or `errors.Overloaded` (refused at admission) before anything
        is queued. `prep`: the engine's `prepare` of this plan, made earlier on another thread."""
        stream = RequestStream(len(gens), timeout_s)
        stream.handles = self.engine.start(plan, gens, stream.sink, timeout_s=timeout_s, layout=layout, ticket=ticket,
                                           export=export, prep=prep)
        return stream
