"""Shared pieces of the GPU check (`gpu_check`): shapes, the timing setup, a held-tensor store,
synthetic passages of a fixed token length, KL between logits, and one call under torch.profiler."""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blend_engine.engine import BlendEngine
from blend_engine.kv_store import ChunkKV, KVStore, StoreStats

if TYPE_CHECKING:
    from torch.profiler import profile

    from blend_engine.model.runner import ModelRunner

logger = logging.getLogger("gpu_check")
LLAMA_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                hidden_size=4096, intermediate_size=14336, vocab_size=128256, max_position_embeddings=32768,
                rope_theta=500000.0)
TINY = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            hidden_size=128, intermediate_size=256, vocab_size=49152, max_position_embeddings=4096)
PASSAGE_TOKENS = 256
QUESTIONS = ("Which river flows through the capital?", "Who founded the city?", "When was the bridge built?")


@dataclass(frozen=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    smoke: bool

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


class HeldStore(KVStore):
    """KV held as tensors (pinned host memory, or already on the GPU): the fastest a tier can be."""

    def __init__(self, name: str, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.name = name
        self._place = place
        self._items: dict[str, ChunkKV] = {}
        self._stats = StoreStats(name=name)

    def contains(self, key: str) -> bool:
        return key in self._items

    def put(self, key: str, kv: ChunkKV) -> bool:
        self._items[key] = ChunkKV(self._place(kv.k), self._place(kv.v))
        return True

    def get_layer(self, key: str, layer: int):
        kv = self._items.get(key)
        return None if kv is None else kv.layer(layer)

    def get(self, key: str):
        return self._items.get(key)

    def delete(self, key: str) -> bool:
        return self._items.pop(key, None) is not None

    def stats(self) -> StoreStats:
        return self._stats


def kv_format(runner: ModelRunner) -> tuple[str, torch.dtype]:
    """The KV format the timing parts store in, and its dtype: bf16 for a bf16 model, else fp16."""
    return ("bf16", torch.bfloat16) if runner.dtype == torch.bfloat16 else ("fp16", torch.float16)


def profiled(setup: Setup, fn: Callable[[], object], all_threads: bool = False) -> tuple[profile, float]:
    """`fn` once to warm up, then once under torch.profiler (CPU, and CUDA activity on CUDA), the
    device synchronised before the profiler stops: (the profiler, the profiled call's wall ms).
    `all_threads`: record the ops of every thread (the engine loop's, the loader's), where this torch
    can (`_ExperimentalConfig(profile_all_threads=...)`); CUDA kernels are traced from every thread anyway."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    setup.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device.type == "cuda" else [])
    with profile(activities=acts, experimental_config=_threads_config(all_threads)) as prof:
        t0 = time.perf_counter()
        fn()
        setup.sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    return prof, wall_ms


def _threads_config(all_threads: bool):
    """The profiler's config recording every thread's ops, None (its default) when not asked or when
    this torch has no such option."""
    if not all_threads:
        return None
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: the calling thread's ops only
        logger.warning("this torch's profiler records the calling thread's ops only")
        return None


def pinned_store(setup: Setup, dtype: torch.dtype) -> HeldStore:
    """KV held in host memory in `dtype`, pinned on CUDA (the fastest host tier)."""
    pin = setup.device.type == "cuda"
    return HeldStore("pinned", lambda t: t.to("cpu", dtype).pin_memory() if pin else t.to("cpu", dtype))


def median_ms(fn: Callable[[], object], setup: Setup, reps: int) -> float:
    fn()  # warm-up (allocator, kernels, page cache)
    times = []
    for _ in range(reps):
        setup.sync()
        t0 = time.perf_counter()
        fn()
        setup.sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def words(rng: random.Random, n: int) -> str:
    vocab = ("river city bridge tower market harbour castle museum garden station library church square "
             "north south east west old new great small long built founded named crossed opened closed "
             "king queen merchant sailor painter council century year winter summer stone iron wood").split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def make_passages(engine: BlendEngine, n_tokens: int, seed: int) -> list[str]:
    """Passages of ~PASSAGE_TOKENS tokens each, enough for ~n_tokens of context."""
    rng = random.Random(seed)
    out = []
    while sum(len(engine.passage_tokens(p)) for p in out) + PASSAGE_TOKENS <= n_tokens:
        text = words(rng, PASSAGE_TOKENS)
        while len(engine.passage_tokens(text)) > PASSAGE_TOKENS:
            text = text.rsplit(" ", 1)[0]
        out.append(text)
    return out


def cache_kv(engine: BlendEngine, passages: list[str], stores: list[KVStore], batch: int = 16) -> None:
    ids = [engine.passage_tokens(p) for p in passages]
    for start in range(0, len(ids), batch):
        part = ids[start:start + batch]
        for tokens, kv in zip(part, engine.precompute_many(part, batch_size=batch)):
            for store in stores:
                store.put(engine.key_of(tokens), kv)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.float(), -1)
    q = torch.log_softmax(q_logits.float(), -1)
    return float((p.exp() * (p - q)).sum())

