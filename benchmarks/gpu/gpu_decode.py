"""The GPU check's decode step against its bandwidth floor (issue 39, part 6).

One decode step at batch 1 reads every weight once (the input embeddings only for one row, unless
tied to the head) and the context's K/V once: its floor is those
bytes over the device's memory bandwidth, measured here by a device-to-device copy (bytes read plus
bytes written, over its time). The step is the one serving runs (`pool_step_ms`): the sequence in
a run of the paged pool, stepped at growing positions by `decode_batch` with the engine loop's
defaults (on CUDA: the pool kernel, replayed as a CUDA graph); beside it `dense_step_ms`,
`BlendEngine.decode_step` on the prefill's own dense cache (the public synchronous step, which
serving does not use). Median of `reps` steps after a warm-up, after a full prefill of ~n tokens.
Target on an H200 with the 8B shape: within 2x of the floor.
"""

from __future__ import annotations

import logging

import torch

from benchmarks.gpu.gpu_common import QUESTIONS, HeldStore, Setup, make_passages, median_ms
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan

logger = logging.getLogger("gpu_check")


def copy_bandwidth(setup: Setup, nbytes: int) -> float:
    """Bytes per second a device-to-device copy moves (read + written), the best of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=setup.device)  # [bytes]
    dst = torch.empty_like(src)
    ms = min(median_ms(lambda: dst.copy_(src), setup, 1) for _ in range(5))
    return 2 * nbytes / (ms / 1e3)


def read_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter once, except the input embedding table
    (one row of it is read) unless the output head shares it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def time_decode_floor(setup: Setup, runner: ModelRunner, n_tokens: int, reps: int) -> dict:
    fmt = "bf16" if runner.dtype == torch.bfloat16 else "fp16"
    engine = BlendEngine(runner, HeldStore("none", lambda t: t), EngineConfig(kv_format=fmt))
    passages = make_passages(engine, n_tokens - 64, seed=5)
    plan = BlendPlan(tuple(passages), QUESTIONS[0], mode="full_prefill")
    state = engine.prefill(plan, max_new_tokens=reps + 8)
    cache, token = state.cache, int(state.logits.argmax())
    start = cache.length
    steps = iter(range(reps + 8))

    def step() -> None:
        cache.length = start + next(steps)  # each step appends one token after the previous
        engine.decode_step(cache, token)

    dense_ms = median_ms(step, setup, reps)
    pool_ms = _pool_step_ms(setup, runner, cache, token, reps)
    shape = runner.shape
    weights = read_weight_bytes(runner.model)
    kv = 2 * shape.n_layers * shape.n_kv_heads * start * shape.head_dim * runner.dtype.itemsize
    bandwidth = copy_bandwidth(setup, 1 << 30 if setup.device.type == "cuda" else 64 << 20)
    floor_ms = (weights + kv) / bandwidth * 1e3
    row = {"tokens": start, "step_ms": pool_ms, "dense_step_ms": dense_ms, "weight_bytes": weights, "kv_bytes": kv,
           "copy_gb_per_s": bandwidth / 1e9, "floor_ms": floor_ms, "over_floor": pool_ms / floor_ms}
    logger.info("decode: %s", row)
    return row


def _pool_step_ms(setup: Setup, runner: ModelRunner, cache, token: int, reps: int) -> float:
    """The prefilled sequence copied into a run of a paged pool, stepped as the engine loop steps it
    (`EngineConfig`'s defaults: pooled attention and CUDA graphs on CUDA)."""
    from blend_engine.executor.decode import decode_attention, decode_batch
    from blend_engine.executor.decode_graphs import DecodeGraphs
    from blend_engine.executor.kv_pool import KVPool
    from blend_engine.executor.layers import KVCache
    from blend_engine.scheduler.kv_blocks import Run, blocks_for

    n_blocks = blocks_for(cache.length + reps + 8, 16)
    pool = KVPool(runner, n_blocks, 16)
    seq = KVCache.over(cache.k, cache.v, cache.capacity)  # the prefill's cache, moved into the pool's run
    seq.length = cache.length
    pool.move(seq, Run(0, n_blocks))
    cfg = EngineConfig()
    pooled = decode_attention(cfg.decode_attention, runner.device, [seq]) == "pooled"
    graphs = DecodeGraphs(runner, pool) if pooled and cfg.decode_graphs == "auto" and setup.device.type == "cuda" \
        else None

    def step() -> None:  # each step appends one token after the previous
        decode_batch(runner, [seq], [token], [seq.length], cfg.decode_attention, graphs)

    return median_ms(step, setup, reps)
