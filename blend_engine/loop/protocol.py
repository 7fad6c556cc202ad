"""What the engine loop needs of the engine, and nothing more (the engine sees the loop as a concrete
`EngineLoop`: submit, run_task, run_stepped, check_fits, stats, close)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from blend_engine.executor.layers import KVCache, LayerHooks
from blend_engine.executor.prefill import PrefillRun, PrefillState
from blend_engine.layout import PromptLayout
from blend_engine.model.runner import ModelRunner
from blend_engine.steps import Steps
from blend_engine.types import BlendPlan

if TYPE_CHECKING:
    from blend_engine.loop.requests import Prepared


class ChunkStoring(Protocol):
    """The chunk cache's write of a missed passage's alone-KV, a layer a unit
    (`chunk_cache.ChunkCache.store_steps`)."""

    def store_steps(self, token_ids: Sequence[int], salt: str | None = None) -> Steps[bool]: ...


class EngineSide(Protocol):
    """`engine.BlendEngine` as the loop uses it: the model, the chunk cache, and a prefill's plan,
    start and completion (host work and the executor's tensors)."""

    runner: ModelRunner
    chunks: ChunkStoring

    def prepare(self, plan: BlendPlan, max_new_tokens: int, layout: PromptLayout | None = None) -> Prepared: ...

    def start_run(self, plan: BlendPlan, prep: Prepared, max_new_tokens: int, hooks: LayerHooks = ...,
                  cache: KVCache | None = None) -> PrefillRun: ...

    def complete_run(self, plan: BlendPlan, prep: Prepared, run: PrefillRun) -> PrefillState: ...
