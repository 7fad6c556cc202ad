"""Part (2) and (3) of the GPU check: time to first token per mode and KV tier, the selected rows'
attention kernels, and ingestion's KV precompute. Timings only: random weights."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.gpu.gpu_common import (
    LLAMA_8B,
    PASSAGE_TOKENS,
    QUESTIONS,
    TINY,
    HeldStore,
    Setup,
    cache_kv,
    kv_format,
    make_passages,
    median_ms,
    pinned_store,
)
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.attention import compile_failed, flex_attend, selected_block_mask
from blend_engine.kv_store import KVStore, MemoryStore
from blend_engine.kv_store.disk import DiskStore
from blend_engine.kv_store.factory import build_store
from blend_engine.kv_store.loader import LayerLoader
from blend_engine.model.runner import ModelRunner
from blend_engine.scheduler.controller import BandwidthController
from blend_engine.types import BlendPlan

logger = logging.getLogger("gpu_check")


def random_runner(setup: Setup, tokenizer) -> ModelRunner:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = TINY if setup.smoke else LLAMA_8B
    config = LlamaConfig(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(config, dtype=setup.dtype)
    return ModelRunner(model, tokenizer, "llama-3.1-8b-shape (random)" if not setup.smoke else "tiny (random)")


DEVICE_TIER_BYTES = 24 << 30  # the device tier row's budget: 16K tokens of the 8B shape are 2 GiB


def tier_stores(setup: Setup, runner: ModelRunner, n: int, root: Path) -> tuple[dict[str, KVStore], list[str]]:
    """The KV tiers the TTFT part blends from, each holding the KV of the same ~n tokens of passages
    (disk tiers under `root`): (the stores by tier, the passages)."""
    fmt, dt = kv_format(runner)
    stores: dict[str, KVStore] = {
        "pinned RAM": pinned_store(setup, dt),
        "local disk": DiskStore(root / f"disk{n}", 64 << 30, kv_format=fmt),
        "GPU": HeldStore("gpu", lambda t: t.to(setup.device, dt)),
        # the service's own stores: its memory tier (pinned on CUDA), and memory over disk with an empty
        # memory tier (budget 0), so every layer comes from the disk tier through the tiered store
        "service RAM": MemoryStore(64 << 30, kv_format=fmt),
        "service tiered disk": build_store(kv_format=fmt, memory_bytes=0, disk_dir=root / f"tiered{n}",
                                           disk_bytes=64 << 30),
        # its device tier above the memory tier (issue #27): every chunk written through, so every
        # layer is a device hit and nothing crosses the bus
        "service device tier": build_store(kv_format=fmt, memory_bytes=64 << 30, device_bytes=DEVICE_TIER_BYTES,
                                           device=str(setup.device)),
    }
    base = BlendEngine(runner, stores["GPU"], EngineConfig(kv_format=fmt))
    passages = make_passages(base, n - 64, seed=n)
    cache_kv(base, passages, list(stores.values()))
    return stores, passages


def tier_engine(runner: ModelRunner, store: KVStore, controller: BandwidthController | None = None) -> BlendEngine:
    """An engine blending from `store` through the layer loader (2 layers ahead), as the TTFT rows run."""
    return BlendEngine(runner, store, EngineConfig(kv_format=kv_format(runner)[0]), loader=LayerLoader(store, 2),
                       controller=controller)


def time_ttft(setup: Setup, runner: ModelRunner, n: int, tmp: Path, reps: int, variants: bool = True) -> dict:
    """Every configuration at a context of about n tokens (the flex and int8 variants if `variants`)."""
    fmt = kv_format(runner)[0]
    stores, passages = tier_stores(setup, runner, n, tmp)
    base = BlendEngine(runner, stores["GPU"], EngineConfig(kv_format=fmt))
    plan = BlendPlan(tuple(passages), QUESTIONS[0], mode="full_prefill")
    layout = base.layout(plan)
    ids = torch.tensor([layout.token_ids()], device=setup.device)
    row: dict = {"tokens": layout.n_tokens, "layout_ms": median_ms(lambda: base.layout(plan), setup, reps)}
    with torch.inference_mode():
        row["hf_forward_ms"] = median_ms(lambda: runner.model(ids, logits_to_keep=1), setup, reps)
    row["full_prefill_ms"] = median_ms(lambda: base.prefill(plan), setup, reps)
    for where, store in stores.items():
        engine = tier_engine(runner, store)
        for mode, ratio, label in (("full_reuse", None, "full_reuse"), ("blend", 0.15, "blend@0.15")):
            p = BlendPlan(tuple(passages), QUESTIONS[0], mode=mode, recompute_ratio=ratio)
            row[f"{label} {where}_ms"] = median_ms(lambda p=p, e=engine: e.prefill(p), setup, reps)
    if variants:
        row.update(recorded("variants", lambda: time_variants(setup, runner, passages, stores["pinned RAM"], fmt,
                                                              reps)))
    disk = stores["local disk"]
    auto = tier_engine(runner, disk, BandwidthController())
    auto_plan = BlendPlan(tuple(passages), QUESTIONS[0], mode="blend")
    row["blend@auto local disk_ms"] = median_ms(lambda: auto.prefill(auto_plan), setup, reps)
    last = auto.prefill(auto_plan).report
    row["auto_served_by"] = last.mode
    row["auto_ratio"] = last.recompute_ratio
    logger.info("%s", row)
    return row


def recorded(name: str, fn: Callable[[], dict]) -> dict:
    """A part of a part: its failure becomes `{name}_error` (the last traceback lines) in the row."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the rest of the row is still worth having
        logger.exception("%s failed", name)
        return {f"{name}_error": "".join(traceback.format_exception(exc))[-2000:]}


def time_variants(setup: Setup, runner: ModelRunner, passages: list[str], pinned: KVStore, fmt: str,
                  reps: int) -> dict:
    """blend@0.15 with the selected rows through FlexAttention (KV in pinned RAM; its first prefill,
    which compiles flex_attention on CUDA, timed apart), and with the KV stored as int8 in RAM
    (moved as int8, dequantized on the GPU)."""
    plan = BlendPlan(tuple(passages), QUESTIONS[0], mode="blend", recompute_ratio=0.15)
    flex = BlendEngine(runner, pinned, EngineConfig(kv_format=fmt, selected_attention="flex"),
                       loader=LayerLoader(pinned, 2))
    setup.sync()
    t0 = time.perf_counter()
    flex.prefill(plan)
    setup.sync()
    out = {"flex_first_prefill_s": time.perf_counter() - t0}
    out["blend@0.15 flex pinned RAM_ms"] = median_ms(lambda: flex.prefill(plan), setup, reps)
    out["flex_compile_failed"] = compile_failed()  # then the row above ran the boolean-mask fallback
    int8 = MemoryStore(64 << 30, kv_format="int8")
    engine8 = BlendEngine(runner, int8, EngineConfig(kv_format="int8"), loader=LayerLoader(int8, 2))
    cache_kv(engine8, passages, [int8])
    out["blend@0.15 int8 RAM_ms"] = median_ms(lambda: engine8.prefill(plan), setup, reps)
    return out


def time_attention(setup: Setup, n: int, ratio: float, reps: int) -> dict:
    """The selected rows' attention at n tokens (S = ratio x n rows, sorted positions): one boolean
    mask [S, N] (the device path: SDPA's memory-efficient kernel), the same as an additive float
    mask, and the CPU path's 4 position-ordered blocks (needs the block ends on the host)."""
    shape = TINY if setup.smoke else LLAMA_8B
    hq, h, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    s = max(1, int(ratio * n))
    g = torch.Generator(device="cpu").manual_seed(0)
    pos = torch.sort(torch.randperm(n - 1, generator=g)[:s - 1]).values.tolist() + [n - 1]
    pos_t = torch.tensor(pos, device=setup.device)  # [S]
    q = torch.randn(1, hq, s, d, device=setup.device, dtype=setup.dtype)
    k = torch.randn(1, h, n, d, device=setup.device, dtype=setup.dtype)
    v = torch.randn(1, h, n, d, device=setup.device, dtype=setup.dtype)
    allowed = torch.arange(n, device=setup.device)[None, :] <= pos_t[:, None]  # [S, N]
    additive = torch.zeros(allowed.shape, dtype=setup.dtype, device=setup.device).masked_fill(~allowed, float("-inf"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    blocks = []
    for idx in torch.tensor_split(torch.arange(s), 4):
        hi = pos[int(idx[-1])] + 1
        blocks.append((idx.to(setup.device), hi, allowed[idx.to(setup.device), :hi]))
    out = {"tokens": n, "rows": s}
    out["bool_mask_ms"] = median_ms(lambda: sdpa(q, k, v, attn_mask=allowed, enable_gqa=True), setup, reps)
    group = hq // h
    ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [1, Hq, N, D]
    out["bool_mask_expanded_kv_ms"] = median_ms(
        lambda: sdpa(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), attn_mask=allowed),
        setup, reps)  # what the engine runs on CUDA (the repeat included)
    out["bool_mask_expanded_only_sdpa_ms"] = median_ms(lambda: sdpa(q, ke, ve, attn_mask=allowed), setup, reps)
    out["float_mask_ms"] = median_ms(lambda: sdpa(q, k, v, attn_mask=additive, enable_gqa=True), setup, reps)
    out["blocks_ms"] = median_ms(lambda: [sdpa(q[:, :, i], k[:, :, :hi], v[:, :, :hi], attn_mask=m, enable_gqa=True)
                                           for i, hi, m in blocks], setup, reps)
    out.update(recorded("flex", lambda: _time_flex(setup, pos_t, q[0], k[0], v[0], reps)))
    q_all = torch.randn(1, hq, n, d, device=setup.device, dtype=setup.dtype)
    out["full_causal_ms"] = median_ms(lambda: sdpa(q_all, k, v, is_causal=True, enable_gqa=True), setup, reps)
    return out


def _time_flex(setup: Setup, pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reps: int) -> dict:
    """FlexAttention of rows at pos [S]: q [Hq, S, D] over k, v [H, N, D] (grouped, as the engine
    calls it); its block mask build apart; the first call (compiles on CUDA) timed alone."""
    n, scale = k.shape[1], q.shape[-1] ** -0.5
    setup.sync()
    t0 = time.perf_counter()
    mask = selected_block_mask(pos, n, None)
    flex_attend(q, k, v, mask, scale)
    setup.sync()
    if compile_failed():  # the calls below would time the eager reference, not the kernel
        raise RuntimeError("compiling flex_attention failed (traceback in the log)")
    return {"flex_first_call_s": time.perf_counter() - t0,
            "flex_block_mask_ms": median_ms(lambda: selected_block_mask(pos, n, None), setup, reps),
            "flex_ms": median_ms(lambda: flex_attend(q, k, v, mask, scale), setup, reps)}


# ============================================================================ (3) ingestion
def time_ingestion(setup: Setup, runner: ModelRunner, n_passages: int, batch: int) -> dict:
    engine = BlendEngine(runner, MemoryStore(1 << 30))
    ids = [engine.passage_tokens(p) for p in make_passages(engine, n_passages * PASSAGE_TOKENS + 1, seed=7)]
    fmt_dt = torch.bfloat16 if runner.dtype == torch.bfloat16 else torch.float16

    def one_at_a_time():
        for t in ids:
            kv = engine.precompute(t)
            kv.k.to("cpu", fmt_dt), kv.v.to("cpu", fmt_dt)

    def batched():
        for start in range(0, len(ids), batch):
            for kv in engine.precompute_many(ids[start:start + batch], batch_size=batch):
                kv.k.to("cpu", fmt_dt), kv.v.to("cpu", fmt_dt)

    single = median_ms(one_at_a_time, setup, 1)
    many = median_ms(batched, setup, 1)
    return {"passages": len(ids), "passage_tokens": PASSAGE_TOKENS, "batch": batch,
            "one_at_a_time_passages_per_s": len(ids) / (single / 1e3), "batched_passages_per_s": len(ids) / (many / 1e3),
            "note": "KV of each passage computed on the device and copied to host memory in the stored dtype"}


