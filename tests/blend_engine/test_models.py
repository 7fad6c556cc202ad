"""Model families: exact against transformers' own forward, blend at ratio 1 == full prefill, the
sliding window in every mode and in decoding, and clear refusals of what cannot be blended.

Each family is a tiny random config (4 layers, 64 hidden) sharing the real tokenizer; biases and
norm weights are perturbed so that qkv bias and q/k norms matter. The test prompt is longer than
every sliding window and every `original_max_position_embeddings` below.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import (
    AutoConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model.families import UnsupportedModel, check_blendable, layer_windows
from blend_engine.model.runner import ModelRunner
from blend_engine.types import BlendPlan, GenerationConfig
from tests.helpers import PASSAGES, QUESTION, perturb, pool_kv, ragged_pool

WINDOW = 24  # sliding window, tokens
ORIGINAL_MAX = 64  # original_max_position_embeddings of the scaled RoPE types

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024)

FAMILIES = {
    "llama": lambda v: LlamaForCausalLM(LlamaConfig(vocab_size=v, **_COMMON)),
    "llama3-rope": lambda v: LlamaForCausalLM(LlamaConfig(vocab_size=v, **_COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX})),
    "linear-rope": lambda v: LlamaForCausalLM(LlamaConfig(vocab_size=v, **_COMMON, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "yarn-rope": lambda v: LlamaForCausalLM(LlamaConfig(vocab_size=v, **{**_COMMON, "max_position_embeddings": 256},
                                                        rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX})),
    "mistral-window": lambda v: MistralForCausalLM(MistralConfig(vocab_size=v, **_COMMON, sliding_window=WINDOW)),
    "qwen2": lambda v: Qwen2ForCausalLM(Qwen2Config(vocab_size=v, **_COMMON)),
    "qwen2-window-mixed": lambda v: Qwen2ForCausalLM(Qwen2Config(vocab_size=v, **_COMMON, use_sliding_window=True,
                                                                 sliding_window=WINDOW, max_window_layers=2)),
    "qwen3": lambda v: Qwen3ForCausalLM(Qwen3Config(vocab_size=v, **_COMMON, head_dim=32)),
}


@pytest.fixture(scope="session")
def tokenizer(real_runner):
    return real_runner.tokenizer


def make_engine(family: str, tokenizer) -> BlendEngine:
    torch.manual_seed(0)
    runner = ModelRunner(perturb(FAMILIES[family](len(tokenizer))), tokenizer, f"tiny-{family}")
    return BlendEngine(runner, MemoryStore(1 << 30, kv_format="fp32"), EngineConfig(kv_format="fp32"))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_engine(request, tokenizer) -> BlendEngine:
    return make_engine(request.param, tokenizer)


def _hf_last_logits(engine: BlendEngine, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return engine.runner.model(torch.tensor([ids])).logits[0, -1]  # [V]


def test_prompt_is_longer_than_every_window_and_original_context(family_engine):
    n = family_engine.layout(BlendPlan(PASSAGES, QUESTION)).n_tokens
    assert n > 2 * WINDOW and n > ORIGINAL_MAX


def test_full_prefill_matches_transformers_forward(family_engine):
    state = family_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"))
    ref = _hf_last_logits(family_engine, state.layout.token_ids())
    assert (state.logits - ref).abs().max().item() < 1e-4


def test_blend_at_ratio_one_equals_full_prefill(family_engine):
    for p in PASSAGES:
        family_engine.ensure_cached(p)
    full = family_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"))
    blend = family_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="blend", recompute_ratio=1.0))
    assert blend.report.cache_hits >= len(PASSAGES)
    assert (blend.logits - full.logits).abs().max().item() < 1e-4


def test_decoding_matches_transformers_past_the_window(family_engine):
    """decode_step after a prefill: each new token's logits equal transformers' over the whole sequence."""
    state = family_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"), max_new_tokens=3)
    ids = state.layout.token_ids()
    for tok in family_engine.runner.encode(" Spree river")[:3]:
        ours = family_engine.decode_step(state.cache, tok)
        ids.append(tok)
        assert (ours - _hf_last_logits(family_engine, ids)).abs().max().item() < 1e-4


def test_a_batched_decode_step_matches_transformers_per_row(family_engine):
    """Two sequences of different lengths decoded in one step (its projections and MLP over 2 rows:
    `rows_linear`'s transposed product on the CPU): each row's logits equal transformers'."""
    from blend_engine.executor.decode import decode_batch

    plans = [BlendPlan(PASSAGES, QUESTION, mode="full_prefill"), BlendPlan(PASSAGES[:1], QUESTION, mode="full_prefill")]
    states = [family_engine.prefill(p, max_new_tokens=2) for p in plans]
    tokens = family_engine.runner.encode(" Spree")[:1] * 2
    got = decode_batch(family_engine.runner, [s.cache for s in states], tokens,
                       [s.cache.length for s in states])  # [2, V]
    for row, (state, tok) in enumerate(zip(states, tokens)):
        want = _hf_last_logits(family_engine, state.layout.token_ids() + [tok])  # [V]
        assert (got[row] - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["mistral-window", "qwen2-window-mixed"])
def test_window_applies_in_full_reuse_and_precompute(family, tokenizer):
    """full_reuse over an exact cached system prefix (precomputed alone, longer than the window) and
    passages that missed (recomputed in context through the selection path) is exactly full prefill."""
    engine = make_engine(family, tokenizer)
    plan = BlendPlan(PASSAGES, QUESTION, mode="full_reuse")
    sys_ids = engine.layout(plan).segments[0].token_ids
    assert len(sys_ids) > WINDOW
    engine.store.put(engine.key_of(sys_ids), engine.precompute(sys_ids))
    reuse = engine.prefill(plan)
    assert reuse.report.cache_hits == 1 and reuse.report.cache_misses == len(PASSAGES)
    ref = _hf_last_logits(engine, reuse.layout.token_ids())
    assert (reuse.logits - ref).abs().max().item() < 1e-4


def test_sliding_window_per_layer():
    mistral = MistralConfig(num_hidden_layers=3, sliding_window=7)
    qwen = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=9, max_window_layers=2)
    assert layer_windows(mistral) == (7, 7, 7)
    assert layer_windows(qwen) == (None, None, 9, 9)
    assert layer_windows(Qwen2Config(num_hidden_layers=2)) == (None, None)  # use_sliding_window off


def test_rope_tables_are_private_and_stable_across_threads(tokenizer):
    """Our inv_freq is a copy fixed at load time: threads computing tables for different lengths
    all get the single-threaded answer, and the model's own buffer is not the one we use."""
    engine = make_engine("yarn-rope", tokenizer)
    r = engine.runner
    assert r._inv_freq.data_ptr() != r.model.model.rotary_emb.inv_freq.data_ptr()
    expected = {n: r.rope(torch.arange(n)) for n in (8, 200)}
    bad: list[int] = []

    def work(n: int) -> None:
        for _ in range(20):
            cos, sin = r.rope(torch.arange(n))
            if not (torch.equal(cos, expected[n][0]) and torch.equal(sin, expected[n][1])):
                bad.append(n)

    threads = [threading.Thread(target=work, args=(n,)) for n in (8, 200, 8, 200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


# ---------------------------------------------------------------------- refusals (config level)
def _cfg(model_type: str, **kw):
    return AutoConfig.for_model(model_type, **kw)


@pytest.mark.parametrize(
    "config, message",
    [
        (lambda: LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
         "RoPE type 'dynamic'.*change with the sequence"),
        (lambda: _cfg("phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                               "short_factor": [1.0] * 48, "long_factor": [2.0] * 48,
                                               "original_max_position_embeddings": 4096}),
         "'phi3'.*fused qkv_proj"),
        (lambda: LlamaConfig(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 64,
                                              "long_factor": [2.0] * 64, "original_max_position_embeddings": 4096}),
         "RoPE type 'longrope'"),
        (lambda: _cfg("gemma2"), "'gemma2'.*soft-capping"),
        (lambda: _cfg("gemma"), "'gemma'.*RMSNorm"),
        (lambda: _cfg("mixtral"), "'mixtral'.*mixture-of-experts"),
        (lambda: _cfg("qwen3_moe"), "'qwen3_moe'.*mixture-of-experts"),
        (lambda: _cfg("deepseek_v3"), "'deepseek_v3'.*latent attention"),
        (lambda: _cfg("gpt2"), "unsupported architecture 'gpt2'"),
    ],
)
def test_unblendable_checkpoints_are_refused_with_type_and_reason(config, message):
    with pytest.raises(UnsupportedModel, match=message):
        check_blendable(config())


def test_generic_checks_catch_moe_and_softcapping_on_a_supported_type():
    cfg = Qwen2Config()
    cfg.num_experts = 8
    with pytest.raises(UnsupportedModel, match="mixture-of-experts"):
        check_blendable(cfg)
    cfg = LlamaConfig()
    cfg.attn_logit_softcapping = 50.0
    with pytest.raises(UnsupportedModel, match="attn_logit_softcapping"):
        check_blendable(cfg)


def test_refusal_stops_loading_a_checkpoint_folder(tmp_path):
    """The start path: a folder whose config cannot be blended fails before any weight is read."""
    from blend_engine.model.files import _load_hf

    LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="dynamic"):
        _load_hf(str(tmp_path), torch.float32)


@pytest.mark.parametrize("family", ["llama", "llama3-rope", "linear-rope", "yarn-rope", "mistral-window", "qwen2",
                                    "qwen3"])
def test_supported_families_pass_the_check(family):
    check_blendable(FAMILIES[family](64).config)


def test_the_paged_pool_matches_the_dense_path_with_and_without_a_prefix_hit(family_engine):
    """The engine loop (KV in a run of the paged pool; the second run takes the cached prefix and
    computes only the rest) against the dense per-sequence oracle (`prefill` + `decode_step`), past
    every window: the same greedy tokens, their log probabilities within 1e-4."""
    plan = BlendPlan(PASSAGES, QUESTION, mode="full_prefill")
    state = family_engine.prefill(plan, max_new_tokens=6)
    logits, want = state.logits, []
    for _ in range(6):
        tok = int(logits.argmax())
        want.append((tok, float(torch.log_softmax(logits.float(), -1)[tok])))
        logits = family_engine.decode_step(state.cache, tok)
    gen = GenerationConfig(max_tokens=6, ignore_eos=True, logprobs=0)
    for reused in (False, True):
        got = family_engine.run(plan, gen)
        assert (got.report.prefix_tokens_reused > 0) is reused
        assert list(got.token_ids) == [t for t, _ in want]
        assert max(abs(lp.logprob - w) for lp, (_, w) in zip(got.logprobs, want)) < 1e-4


def test_sdpa_restriction_is_scoped_to_the_call_and_changes_no_result(tokenizer):
    """A CUDA runner keeps SDPA off cuDNN's kernels (a plan per new shape made an H200 decode step
    100 ms instead of 36: benchmarks/results/gpu/sdpa_ab). The restriction is the runner's seam
    (`sdpa_backends`, None on a CPU), holds only inside its calls, and gives the same attention."""
    from blend_engine.model.runner import CUDA_SDPA_BACKENDS, _sdpa_backends

    assert "CUDNN_ATTENTION" not in CUDA_SDPA_BACKENDS
    engine = make_engine("llama", tokenizer)
    runner = engine.runner
    assert runner.sdpa_backends is None  # CPU: whatever torch picks
    q, k, v = torch.randn(4, 5, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16)  # [Hq, S, D], [H, N, D] x2
    mask = torch.rand(5, 9) > 0.3  # [S, N]
    mask[:, 0] = True
    free = runner.attend(q, k, v, mask)  # [S, Hq*D]
    runner.sdpa_backends = _sdpa_backends(("MATH",))
    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
    try:
        torch.testing.assert_close(runner.attend(q, k, v, mask), free)
    finally:
        runner.sdpa_backends = None
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before == (True, True)


@pytest.mark.parametrize("bias", [False, True])
def test_a_few_rows_go_through_the_transposed_product_with_the_same_result(bias, monkeypatch):
    """`rows_linear` where the CPU kernels are not built (3-128 rows go to `cpu_kernels.rows_linear`
    otherwise; 1-2 rows always come here): 1..96 fp32 rows on the CPU run as W @ x^T on `padded_rows`
    rows, faster there; every row count gives nn.Linear's result, and what is not an fp32 nn.Linear
    on 2-D rows is handed to the module itself."""
    from blend_engine.model import cpu_kernels
    from blend_engine.model.runner import SMALL_ROWS, padded_rows, rows_linear

    monkeypatch.setattr(cpu_kernels, "ROWS", range(0))

    assert [padded_rows(n) for n in (1, 2, 7, 8, 9, 15, 16, 17, 96)] == [2, 2, 7, 8, 16, 16, 16, 24, 96]
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias)
    for rows in (1, 2, 9, 15, 17, SMALL_ROWS[-1], SMALL_ROWS[-1] + 1, 300):
        x = torch.randn(rows, 48)  # [T, in]
        got = rows_linear(layer, x)  # [T, out]
        assert got.shape == (rows, 80) and got.is_contiguous()
        torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(3, 48)
    assert torch.equal(rows_linear(layer.to(torch.bfloat16), x.bfloat16()), layer(x.bfloat16()))  # not fp32
    assert torch.equal(rows_linear(layer.float(), x[None]), layer(x[None]))  # not [T, in]


def _triton_on_cuda() -> bool:
    from blend_engine.executor import paged_decode

    return torch.cuda.is_available() and paged_decode.triton is not None


PATHS = ["pooled", "padded_static",  # the kernel per family on a GPU; under the interpreter: test_paged_decode.py
         pytest.param("triton", marks=pytest.mark.skipif(not _triton_on_cuda(), reason="needs Triton on CUDA")),
         "cpu"]  # `cpu_kernels` (built here: a failed build fails the test)


@pytest.mark.parametrize("path", PATHS)
def test_pooled_decode_attention_equals_the_per_sequence_oracle(family_engine, path):
    """One attention call a layer over keys gathered from the paged pool gives the per-sequence
    path's logits and writes the same K/V, for ragged lengths past a sliding window (every family);
    so does the same step at the padded shapes a CUDA graph replays (`decode_graphs`, run eagerly:
    3 rows padded to 4, keys to a bucket of 256), whose padding row writes only the scratch block,
    and the kernels that read the pool in place (Triton, `paged_decode`; C++ on the CPU, `cpu_kernels`)."""
    from blend_engine.executor.decode import decode_attention, decode_batch
    from blend_engine.executor.decode_graphs import DecodeGraphs

    runner = family_engine.runner
    pool, runs, lengths = ragged_pool(runner)
    before = [(k.clone(), v.clone()) for k, v in zip(*pool.kv)]
    tokens = [11, 22, 33]
    caches = [pool.view(run, n) for run, n in zip(runs, lengths)]
    want = decode_batch(runner, caches, tokens, lengths, attention="per_sequence")  # [B, V]
    slots = pool.scratch_slot
    wrote = pool_kv(pool, slots)
    for (k, v), (k0, v0) in zip(zip(*pool.kv), before):
        k.copy_(k0)
        v.copy_(v0)
    caches = [pool.view(run, n) for run, n in zip(runs, lengths)]
    assert decode_attention("pooled", runner.device, caches) == "pooled"
    if path == "cpu":
        from blend_engine.model import cpu_kernels

        if runner.device.type != "cpu":
            pytest.skip("the CPU kernel reads a CPU pool")
        assert cpu_kernels.ensure(), cpu_kernels.why_not()
    graphs = DecodeGraphs(runner, pool, capture=False) if path == "padded_static" else None
    kernel = path if path in ("triton", "cpu") else "gather"
    got = decode_batch(runner, caches, tokens, lengths, attention="pooled", graphs=graphs, kernel=kernel)  # [B, V]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert [c.length for c in caches] == [n + 1 for n in lengths]
    for (k, v), (wk, wv) in zip(pool_kv(pool, slots), wrote):  # the same slots written, to fp rounding
        torch.testing.assert_close(k, wk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, wv, rtol=1e-4, atol=1e-5)
    scratch_written = any(bool(k[:, slots].abs().sum() > 0) for k, _ in zip(*pool.kv))
    assert scratch_written == (path == "padded_static")


def test_decode_graph_buckets():
    """Captured shapes: batch sizes up to 64 (None beyond), keys padded by less than 256 or a quarter."""
    from blend_engine.executor.decode_graphs import BATCH_BUCKETS, batch_bucket, key_bucket

    assert [batch_bucket(b) for b in (1, 3, 9, 17, 33, 64)] == [1, 4, 16, 24, 48, 64]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    for n in (1, 255, 256, 257, 1000, 1025, 5000, 8192, 40000):
        assert 0 <= key_bucket(n) - n < max(256, n // 4 + 1), n
    assert len({key_bucket(n) for n in range(1025, 2049)}) == 4  # 4 graphs an octave


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_replayed_decode_graph_equals_the_eager_step():
    """On a GPU: steps replayed from captured graphs (growing positions, a new key bucket, a batch
    that shrinks) give the same padded step's logits and K/V run eagerly, and the unpadded eager
    step's greedy tokens."""
    from benchmarks.gpu.decode_graph_check import compare_captured_and_eager
    from blend_engine.model.runner import ModelRunner

    report = compare_captured_and_eager(ModelRunner.load(device="cuda", dtype="float32"), steps=6)
    assert report["graphs"] >= 2 and report["captured_vs_padded_logit_diff"] < 1e-3, report
    assert report["captured_vs_padded_kv_diff"] < 1e-3 and report["greedy_equal"], report


def test_bf16_linear_weights_run_the_projections_and_stay_close_to_float32(real_runner):
    """`linear_dtype` bfloat16 (BLENDSERVE_MODEL_LINEAR_DTYPE): the projections run on bf16 copies of
    their weights, norms and attention stay float32. On the real model and a real RAG prompt the first
    token's distribution stays close to float32's, with the same most likely token. Stored passages
    come from transformers' forward on the float32 weights either way: same fingerprint."""
    import torch.nn.functional as F

    from benchmarks.common.scoring import kl

    low = ModelRunner(real_runner.model, real_runner.tokenizer, linear_dtype=torch.bfloat16)
    assert low.fingerprint == real_runner.fingerprint and low.dtype == torch.float32
    q_proj = low._layers[0].self_attn.q_proj
    x = torch.randn(5, low.shape.hidden)  # [T, E]
    assert torch.equal(low.linear(q_proj, x), F.linear(x.bfloat16(), q_proj.weight.bfloat16()).float())
    assert q_proj.weight.dtype == torch.float32  # the model's own weights stay (transformers' forward)
    ids = torch.tensor([low.encode(PASSAGES[0])])  # [1, T]
    k_low, k_ref = (r.prefill_cache(ids, torch.ones_like(ids))[3][0] for r in (low, real_runner))  # [1, H, T, D]
    assert torch.equal(k_low, k_ref)  # a stored passage's K/V: the same under either setting

    plan = BlendPlan(PASSAGES, QUESTION, mode="full_prefill")
    ref, got = (BlendEngine(r, MemoryStore(), EngineConfig()) for r in (real_runner, low))
    p, q = (e.prefill(plan).logits for e in (ref, got))  # [V] each
    assert 0 < kl(p, q) < 0.01 and p.argmax() == q.argmax()  # 0.0009 measured; blend@0.15 vs full prefill: 0.057


def test_bf16_linear_weights_are_refused_where_they_would_not_help(monkeypatch):
    from blend_engine.model import files
    from blend_engine.model.files import pick_linear_dtype

    cpu = torch.device("cpu")
    assert pick_linear_dtype(cpu, torch.float32, "auto") is None and pick_linear_dtype(cpu, torch.float32) is None
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        pick_linear_dtype(cpu, torch.bfloat16, "bfloat16")
    with pytest.raises(ValueError, match="float32 model on the CPU"):
        pick_linear_dtype(torch.device("cuda"), torch.float32, "bfloat16")
    monkeypatch.setattr(files, "cpu_has_bf16", lambda: False)
    with pytest.raises(ValueError, match="native bf16 matmuls"):
        pick_linear_dtype(cpu, torch.float32, "bfloat16")
    monkeypatch.setattr(files, "cpu_has_bf16", lambda: True)
    assert pick_linear_dtype(cpu, torch.float32, "bfloat16") is torch.bfloat16
