"""The chunk cache: each chunk's KV computed alone at positions 0..T-1, stored under a content key.

    | sys | chunk_1 .. chunk_k | question |
      ^each cached alone, keyed by hash(model fingerprint, KV format, token ids[, salt])

Keys never depend on a chunk's position in a prompt. The one place that computes a chunk's
alone-KV (`precompute`, `precompute_many`) and stores it unless already there (`cache_ids`,
`store_missing`, and `store_steps`, a layer a unit for the engine loop's background storing):
ingestion, the fidelity gate and the engine all call it.

Cancellation is explicit: each of these takes an optional `should_stop` (`blend_engine.cancel`),
checked between the layers of one chunk's precompute and between the forwards of a batched one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blend_engine.cancel import StopCheck, stop_if
from blend_engine.errors import InputError
from blend_engine.keys import chunk_key
from blend_engine.kv_store import ChunkKV, KVStore
from blend_engine.layout import PromptLayout, passage_text
from blend_engine.model.runner import ModelRunner

from .executor.layers import LayerJob, LayerLoop, run_layers
from .steps import Steps, drain


class ChunkCache:
    """Holds the runner, the store and the store fingerprint; no per-request state."""

    def __init__(self, runner: ModelRunner, store: KVStore, fingerprint: str) -> None:
        self.runner, self.store, self.fingerprint = runner, store, fingerprint

    def key_of(self, token_ids: Sequence[int], salt: str | None = None) -> str:
        """Content key of a chunk; a salt (tenant, `BlendPlan.cache_salt`) gives another key space."""
        return chunk_key(self.fingerprint if not salt else f"{self.fingerprint}/{salt}", token_ids)

    def passage_tokens(self, passage: str) -> list[int]:
        """Token ids of a passage exactly as it is cached and placed in prompts."""
        return self.runner.encode(passage_text(passage))

    def check_fits(self, n_tokens: int, extra: int = 0) -> None:
        limit = self.runner.shape.max_positions
        if n_tokens + extra > limit:
            raise InputError(
                f"prompt of {n_tokens} tokens plus {extra} new tokens exceeds the model context of {limit}"
            )

    @torch.inference_mode()
    def precompute(self, token_ids: Sequence[int], should_stop: StopCheck | None = None) -> ChunkKV:
        """Prefill a chunk alone at positions 0..T-1; every layer's K (after RoPE) and V. Raises
        `Cancelled` before a layer once `should_stop()` is true."""
        job = self._alone(token_ids)
        out = run_layers(self.runner, job, should_stop, "a precompute")
        return out.cache.segment(0, len(job.ids))  # k, v: [L, H, T, D]

    def _alone(self, token_ids: Sequence[int]) -> LayerJob:
        """The pass that prefills a chunk alone (every token computed, positions 0..T-1), checked to fit."""
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.runner.device)  # [T]
        self.check_fits(len(ids))
        return LayerJob(ids)

    @torch.inference_mode()
    def precompute_many(self, token_lists: Sequence[Sequence[int]], batch_size: int = 16,
                        should_stop: StopCheck | None = None) -> list[ChunkKV]:
        """`precompute` for many chunks, batched on the device: chunks of similar length are
        right-padded into one forward of the model (each alone at positions 0..T-1: a causal
        model's real tokens never see the padding after them). Results in input order.
        `should_stop` is checked before each forward (the model's own forward runs the layers)."""
        lists = [list(t) for t in token_lists]
        order = sorted(range(len(lists)), key=lambda i: len(lists[i]))
        out: list[ChunkKV | None] = [None] * len(lists)
        for start in range(0, len(order), batch_size):
            stop_if(should_stop, "between precompute batches")
            group = order[start:start + batch_size]
            longest = len(lists[group[-1]])
            self.check_fits(longest)
            ids = torch.zeros((len(group), longest), dtype=torch.long)  # [B, T]
            mask = torch.zeros((len(group), longest), dtype=torch.long)  # [B, T]
            for row, i in enumerate(group):
                ids[row, :len(lists[i])] = torch.tensor(lists[i])
                mask[row, :len(lists[i])] = 1
            dev = self.runner.device
            layers = self.runner.prefill_cache(ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True))
            for row, i in enumerate(group):
                t = len(lists[i])
                out[i] = ChunkKV(torch.stack([k[row, :, :t] for k, _ in layers]),  # [L, H, T, D]
                                 torch.stack([v[row, :, :t] for _, v in layers]))  # [L, H, T, D]
        return out  # type: ignore[return-value]

    def cache_ids(self, token_ids: Sequence[int], salt: str | None = None,
                  should_stop: StopCheck | None = None) -> tuple[str, bool]:
        """Make sure the alone-KV of these chunk tokens is stored: (key, was already cached)."""
        key, cached, _ = self._ensure(token_ids, salt, should_stop)
        return key, cached

    def cache_many(self, token_lists: Sequence[Sequence[int]], batch_size: int = 16,
                   salt: str | None = None, should_stop: StopCheck | None = None) -> list[bool]:
        """`cache_ids` for many chunks, the missing ones computed `batch_size` per forward
        (`precompute_many`), `should_stop` checked before each forward. Per chunk: stored now."""
        keys = [self.key_of(ids, salt) for ids in token_lists]
        todo: dict[str, list[int]] = {}
        for key, ids in zip(keys, token_lists):
            if key not in todo and not self.store.contains(key):
                todo[key] = list(ids)
        stored: set[str] = set()
        items = list(todo.items())
        for start in range(0, len(items), batch_size):
            stop_if(should_stop, "between precompute batches")
            group_keys, lists = zip(*items[start:start + batch_size])
            for key, kv in zip(group_keys, self.precompute_many(lists, batch_size)):
                if self.store.put(key, kv):
                    stored.add(key)
        out = []
        for key in keys:  # a chunk repeated in the input is stored once, counted once
            out.append(key in stored)
            stored.discard(key)
        return out

    @torch.inference_mode()
    def store_missing(self, layout: PromptLayout, missing: Sequence[int], salt: str | None = None) -> int:
        """After answering: store the alone-KV of the segments that missed the cache. How many were stored."""
        return sum(drain(self.store_steps(layout.segments[i].token_ids, salt)) for i in missing)

    def store_steps(self, token_ids: Sequence[int], salt: str | None = None) -> Steps[bool]:
        """`cache_ids` as a stepped job (`steps`): one layer of the chunk's precompute a unit, then
        one write of the whole entry (a job dropped half-way writes nothing). Whether it stored one;
        nothing to do when the store holds the key already. Run under `torch.inference_mode()` (the
        engine loop's turns are)."""
        key = self.key_of(token_ids, salt)
        if self.store.contains(key):
            return False
        job = self._alone(token_ids)
        loop = LayerLoop(self.runner, job)
        for layer, _ in enumerate(loop.steps()):  # runs a layer
            if layer + 1 < self.runner.shape.n_layers:
                yield  # between two layers: the last one's unit also writes the entry
        kv = loop.output().cache.segment(0, len(job.ids))  # k, v: [L, H, T, D]
        return bool(self.store.put(key, kv))

    def _ensure(self, token_ids: Sequence[int], salt: str | None,
                should_stop: StopCheck | None = None) -> tuple[str, bool, bool]:
        """(key, was already cached, stored now)."""
        key = self.key_of(token_ids, salt)
        if self.store.contains(key):
            return key, True, False
        return key, False, bool(self.store.put(key, self.precompute(token_ids, should_stop)))
