"""How a blend's selected rows attend (`EngineConfig.selected_attention`): FlexAttention with a block
mask from the selected positions, the one boolean-mask SDPA path and the CPU's position-ordered SDPA
blocks equal the CPU's kernel ("auto" here: same selection, logits within float rounding), with full
and sliding-window attention."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from benchmarks.common.policies import plain as plain_policy  # the old field defaults: one kv check
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor import attention
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan
from tests.helpers import PASSAGES, QUESTION, TINY_CONFIG

WINDOW = 24  # shorter than every passage: window layers mask keys the causal mask would let through
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)),
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(**TINY_CONFIG, sliding_window=WINDOW)),
}
PLANS = {
    "blend@0.15": BlendPlan(PASSAGES, QUESTION, mode="blend", recompute_ratio=0.15),
    "blend@0.3 gradual": BlendPlan(PASSAGES, QUESTION, mode="blend", recompute_ratio=0.3,
                                   policy=plain_policy(check_layer=1, metric="kv", schedule=((2, 0.5),))),
    "full_reuse, one miss": BlendPlan(PASSAGES, QUESTION, mode="full_reuse"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def engines(request, real_runner) -> dict[str, BlendEngine]:
    torch.manual_seed(0)
    runner = ModelRunner(MODELS[request.param]().eval(), real_runner.tokenizer, f"tiny-{request.param}")
    store = MemoryStore(1 << 28, kv_format="fp32")
    out = {kind: BlendEngine(runner, store, EngineConfig(kv_format="fp32", selected_attention=kind))
           for kind in ("auto", "blocks", "sdpa_mask", "flex")}
    for p in PASSAGES[:-1]:  # the last passage misses: recomputed in context through the selection path
        out["auto"].ensure_cached(p)
    return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("kind", ["blocks", "sdpa_mask", "flex"])
def test_selected_attention_paths_agree_with_the_cpu_kernel(engines, plan, kind):
    reference = engines["auto"].prefill(PLANS[plan])
    got = engines[kind].prefill(PLANS[plan])
    assert got.report.recomputed_positions == reference.report.recomputed_positions
    assert got.report.recomputed_tokens < got.report.context_tokens  # the selected path ran
    torch.testing.assert_close(got.logits, reference.logits, atol=1e-4, rtol=1e-4)


def test_flex_at_ratio_one_equals_full_prefill(engines):
    full = engines["auto"].prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"))
    one = engines["flex"].prefill(BlendPlan(PASSAGES, QUESTION, mode="blend", recompute_ratio=1.0))
    torch.testing.assert_close(one.logits, full.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engines", ["mistral-window"], indirect=True)
def test_flex_with_a_wrong_window_would_differ(engines):
    """The window matters in these prompts: the same rows without the window give other logits."""
    runner = engines["flex"].runner
    assert any(w is not None for w in runner.windows)
    plan = PLANS["blend@0.15"]
    windowed = engines["flex"].prefill(plan).logits
    saved = runner.windows
    runner.windows = tuple(None for _ in saved)
    try:
        unwindowed = engines["flex"].prefill(plan).logits
    finally:
        runner.windows = saved
    assert (windowed - unwindowed).abs().max() > 1e-3


def test_unknown_selected_attention_is_refused():
    with pytest.raises(ValueError, match="selected_attention"):
        EngineConfig(selected_attention="fastest")


def test_the_setting_reaches_the_engine(real_runner, monkeypatch):
    from blendserve_config.settings import Settings
    from blendserve_config.stack import build_engine

    monkeypatch.setenv("BLENDSERVE_ENGINE_SELECTED_ATTENTION", "flex")
    engine = build_engine(Settings(_env_file=None), real_runner, MemoryStore(1 << 20))
    assert engine.config.selected_attention == "flex"
    monkeypatch.setenv("BLENDSERVE_ENGINE_SELECTED_ATTENTION", "fastest")
    with pytest.raises(ValueError, match="selected_attention"):
        Settings(_env_file=None)


def test_a_failed_flex_compile_falls_back_to_the_boolean_mask(engines, monkeypatch, caplog):
    """On CUDA a compiler failure (e.g. a recompile for new shapes; CPU inductor 2.13 fails that
    way on the second shape) must not fail requests, nor fall back to the eager reference, which
    materialises S x N x Hq scores: the boolean-mask SDPA path takes over, logged, and stays."""
    def broken(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(attention, "_failed", False)
    monkeypatch.setattr(attention, "_compiled", broken)
    monkeypatch.setattr(attention, "_kernel", lambda device: None if attention._failed else broken)
    plan = PLANS["blend@0.15"]
    want = engines["sdpa_mask"].prefill(plan)
    with caplog.at_level("ERROR", logger="blend_engine.executor.attention"):
        got = engines["flex"].prefill(plan)
    assert attention.compile_failed()
    assert sum("compiling flex_attention failed" in r.message for r in caplog.records) == 1  # logged once
    assert torch.equal(got.logits, want.logits)  # the very same path, not a near copy
    assert torch.equal(engines["flex"].prefill(plan).logits, want.logits)  # and it stays


@pytest.mark.parametrize("blocks", [1, 3, 16, 200, None])
def test_the_cpu_blocks_agree_with_one_boolean_mask_at_any_block_count(real_runner, blocks):
    """The CPU path splits the selected rows into position-ordered blocks (`query_blocks` of them by
    default); any count attends exactly as the one [S, N] mask does, scattered rows and a tail."""
    from blend_engine.executor.selection import Selection, query_blocks

    r, N, S = real_runner, 300, 90
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.sort(torch.randperm(N - 10, generator=g)[:S - 10]).values, torch.arange(N - 10, N)])  # [S]
    Hq, H, D = r.shape.n_heads, r.shape.n_kv_heads, r.shape.head_dim
    cos, sin = torch.ones(N, D), torch.zeros(N, D)  # [N, D] (unused by attend)
    q = torch.randn(Hq, S, D, generator=g)  # [Hq, S, D]
    K, V = torch.randn(H, N, D, generator=g), torch.randn(H, N, D, generator=g)  # [H, N, D] each
    one_mask = Selection(pos, cos, sin, N, r.window_masks, attention="sdpa_mask").attend(r, q, K, V, 0)  # [S, Hq*D]
    got = Selection(pos, cos, sin, N, r.window_masks, blocks=blocks).attend(r, q, K, V, 0)  # [S, Hq*D]
    torch.testing.assert_close(got, one_mask, atol=1e-5, rtol=1e-5)
    assert (query_blocks(1), query_blocks(31), query_blocks(100), query_blocks(640), query_blocks(5000)) == (1, 1, 3, 16, 16)


@pytest.mark.parametrize("rows, blocks", [(1, None), (90, 3), (100, None), (641, None), (5, 16), (37, 5)])
def test_block_rows_split_as_tensor_split_does(rows, blocks):
    """The blocks' row bounds, host ints made without a tensor (their last positions are then read
    in one go): the sizes `torch.tensor_split` gave the blocks before, never an empty block."""
    from blend_engine.executor.selection import block_rows, query_blocks

    k = min(blocks or query_blocks(rows), rows)
    want = [(int(t[0]), int(t[-1]) + 1) for t in torch.tensor_split(torch.arange(rows), k)]
    assert block_rows(rows, blocks) == want


def test_auto_attends_through_the_cpu_kernel(engines, monkeypatch):
    """On the CPU "auto" sends the layers below the check layer (every row) and the selected rows to
    the kernel; "blocks" never does."""
    from blend_engine.model import cpu_kernels

    rows: list[int] = []
    real = cpu_kernels.selected_attention

    def counted(q, k, v, pos, window, scale):
        rows.append(pos.numel())
        return real(q, k, v, pos, window, scale)

    monkeypatch.setattr(cpu_kernels, "selected_attention", counted)
    engines["blocks"].prefill(PLANS["blend@0.15"])
    assert rows == []
    got = engines["auto"].prefill(PLANS["blend@0.15"])
    assert rows[0] == got.report.context_tokens  # layer 0: every row
    assert min(rows) < got.report.context_tokens  # then the selected rows
