"""Blend engine: exactness at ratio 1, RoPE re-positioning, baselines, generation, bad input.

Fast tests run on small random Llama / Qwen2 configs with the real tokenizer; the ones marked
`slow` use the real default model (SmolLM2-135M).
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.common.policies import plain as plain_policy  # the old field defaults: one kv check
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.model.runner import ModelRunner
from blend_engine.sampling import Sampler, StreamDecoder
from blend_engine.scheduler.budget import PrefillWork
from blend_engine.types import BlendPlan, GenerationConfig, Mode, SelectionPolicy, default_policy
from tests.helpers import PASSAGES, QUESTION, poll, tiny_runner


@pytest.fixture(scope="session")
def tokenizer(real_runner):
    return real_runner.tokenizer


def _tiny(kind: str, tokenizer) -> ModelRunner:
    return tiny_runner(tokenizer, kind, f"tiny-{kind}", vocab_size=len(tokenizer), max_position_embeddings=1024)


def _engine(runner: ModelRunner, kv_format: str = "fp32") -> BlendEngine:
    return BlendEngine(runner, MemoryStore(1 << 30, kv_format=kv_format), EngineConfig(kv_format=kv_format))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_engine(request, tokenizer) -> BlendEngine:
    return _engine(_tiny(request.param, tokenizer))


def _cache_all(engine: BlendEngine, passages=PASSAGES) -> None:
    for p in passages:
        engine.ensure_cached(p)


# ---------------------------------------------------------------------- exactness
def test_full_prefill_matches_transformers_forward(tiny_engine):
    state = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"))
    ids = torch.tensor([state.layout.token_ids()])
    with torch.no_grad():
        ref = tiny_engine.runner.model(ids).logits[0, -1]
    assert torch.allclose(state.logits, ref, atol=1e-4)


def test_blend_at_ratio_one_reproduces_full_prefill(tiny_engine):
    _cache_all(tiny_engine)
    full = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"))
    blend = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="blend", recompute_ratio=1.0))
    assert blend.report.cache_hits >= len(PASSAGES)
    assert (blend.logits - full.logits).abs().max().item() < 1e-3


def test_low_ratio_recomputes_a_subset_but_always_the_question(tiny_engine):
    _cache_all(tiny_engine)
    single_check = plain_policy(check_layer=1, metric="k")
    st = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=single_check))
    question = st.layout.segments[-1]
    chosen = set(st.report.recomputed_positions)
    assert set(range(question.offset, question.end)) <= chosen
    assert st.report.recomputed_tokens < st.report.context_tokens
    n_passage = sum(len(s.token_ids) for s in st.layout.segments if s.kind == "passage")
    passage_chosen = [p for p in chosen if st.layout.segments[0].end <= p < question.offset]
    assert 0 < len(passage_chosen) <= 0.15 * n_passage + 1


def test_full_reuse_recomputes_only_uncached_tokens(tiny_engine):
    _cache_all(tiny_engine)
    st = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_reuse"))
    uncached = [s for s in st.layout.segments if s.kind != "passage"]
    assert st.report.recomputed_tokens <= sum(len(s.token_ids) for s in uncached)
    assert st.report.selected_per_layer[0] == st.report.selected_per_layer[-1]


def test_missed_passage_is_recomputed_in_context_then_stored(tokenizer):
    engine = _engine(_tiny("llama", tokenizer))
    engine.ensure_cached(PASSAGES[0])
    result = engine.run(BlendPlan(PASSAGES[:2], QUESTION), GenerationConfig(max_tokens=2))
    assert result.report.cache_misses >= 1
    seg = engine.layout(BlendPlan(PASSAGES[:2], QUESTION)).segments[2]
    assert set(range(seg.offset, seg.end)) <= set(result.report.recomputed_positions)
    key = engine.key_of(engine.passage_tokens(PASSAGES[1]))
    poll(lambda: engine.store.contains(key))  # stored after the answer, by the loop's background turns


def test_cached_passages_around_a_miss_are_placed_from_fp16(tokenizer):
    engine = _engine(_tiny("llama", tokenizer), kv_format="fp16")
    for p in (PASSAGES[0], PASSAGES[2]):  # PASSAGES[1] misses: cached segments are not contiguous
        engine.ensure_cached(p)
    st = engine.prefill(BlendPlan(PASSAGES[:3], QUESTION, recompute_ratio=1.0))
    full = engine.prefill(BlendPlan(PASSAGES[:3], QUESTION, mode="full_prefill"))
    assert st.report.cache_hits == 2 and st.report.cache_misses >= 1
    assert (st.logits - full.logits).abs().max().item() < 2e-2


def _first(engine, plan):
    """One request through the engine loop (where the KV pool and its prefix cache live): its state."""
    gen = engine.generate(plan, GenerationConfig(max_tokens=1))
    for _ in gen:
        pass
    return gen.state


def test_prefix_cache_mode_is_the_pools_prefix_cache_exact_prefixes_only(tiny_engine):
    """prefix_cache mode takes the longest exact prefix the KV pool holds (whole blocks, never the last
    token): what an exact request of the same prompt (prefix_cache or full prefill) left there, not what a
    blend left (approximate KV), and in another passage order only the shared system prompt."""
    _cache_all(tiny_engine)
    bt = tiny_engine.config.batch.block_tokens
    blended = _first(tiny_engine, BlendPlan(PASSAGES, QUESTION))
    n = blended.layout.n_tokens
    first = _first(tiny_engine, BlendPlan(PASSAGES, QUESTION, mode="prefix_cache"))
    assert first.report.prefix_tokens_reused == 0  # the blend's blocks are not exact
    full = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"))
    again = _first(tiny_engine, BlendPlan(PASSAGES, QUESTION, mode="prefix_cache"))
    assert again.report.prefix_tokens_reused == (n - 1) // bt * bt
    assert again.report.recomputed_tokens == n - again.report.prefix_tokens_reused
    assert (again.logits - full.logits).abs().max().item() < 1e-3
    assert (first.logits - full.logits).abs().max().item() < 1e-3
    shuffled = _first(tiny_engine, BlendPlan(PASSAGES[::-1], QUESTION, mode="prefix_cache"))
    assert shuffled.report.prefix_tokens_reused == shuffled.layout.segments[0].end // bt * bt  # the system prefix
    served = _first(tiny_engine, BlendPlan(PASSAGES[1:], QUESTION, mode="full_prefill"))
    hit = _first(tiny_engine, BlendPlan(PASSAGES[1:], QUESTION, mode="prefix_cache"))
    assert hit.report.prefix_tokens_reused == (served.layout.n_tokens - 1) // bt * bt
    assert (hit.logits - served.logits).abs().max().item() < 1e-3


def test_gradual_filtering_narrows_the_set(tiny_engine):
    _cache_all(tiny_engine)
    policy = plain_policy(check_layer=1, check_multiplier=3.0, schedule=((2, 2.0), (3, 1.0)))
    st = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=policy))
    sizes = st.report.selected_per_layer
    assert sizes[0] == st.report.context_tokens
    assert sizes[1] > sizes[2] > sizes[3]


def _explicit_question_attention(q, k, query_pos, n):
    """Reference: per-head causal softmax of the question's queries over keys, GQA by repetition."""
    group = q.shape[0] // k.shape[0]
    keys = k.repeat_interleave(group, dim=0)[:, :n]  # [Hq, N, D]
    mass = torch.zeros(n)
    for row, p in enumerate(query_pos.tolist()):
        scores = torch.einsum("hd,hnd->hn", q[:, row], keys[:, : p + 1]) * q.shape[-1] ** -0.5  # [Hq, p+1]
        mass[: p + 1] += torch.softmax(scores, dim=-1).sum(0)
    return mass


def test_query_attention_mass_matches_explicit_attention(tiny_engine):
    from blend_engine.executor.selection import RankSpace

    _cache_all(tiny_engine)
    layout = tiny_engine.layout(BlendPlan(PASSAGES, QUESTION))
    cached = [s for s in layout.segments if s.kind != "question"]
    rank = RankSpace(layout, cached, tiny_engine.runner.scaling)
    n, shape = layout.n_tokens, tiny_engine.runner.shape
    torch.manual_seed(1)
    q = torch.randn(shape.n_heads, n, shape.head_dim)  # [Hq, N, D]
    k = torch.randn(shape.n_kv_heads, n, shape.head_dim)  # [H, N, D]
    ref = _explicit_question_attention(q[:, rank.query], k, rank.query, n)  # [N]
    got = rank._attention_mass(q, k, torch.zeros_like(k), None)
    assert torch.allclose(got, ref, atol=1e-4)
    assert got.sum().item() == pytest.approx(shape.n_heads * len(rank.query), rel=1e-4)
    # later layers: fresh keys for the current selection, cached keys elsewhere
    current = torch.cat([torch.arange(5, 20), rank.query])  # [S]
    K = torch.randn_like(k)  # [H, N, D] the cache before this layer's fresh values
    blended = K.clone()
    blended[:, current] = k[:, current]
    got = rank._attention_mass(q[:, current], k[:, current], K, current)
    assert torch.allclose(got, _explicit_question_attention(q[:, rank.query], blended, rank.query, n), atol=1e-4)


def test_query_weighting_prefers_what_the_question_reads(tiny_engine):
    from blend_engine.executor.selection import RankSpace

    layout = tiny_engine.layout(BlendPlan(PASSAGES, QUESTION))
    rank = RankSpace(layout, [s for s in layout.segments if s.kind != "question"], tiny_engine.runner.scaling)
    n, shape = layout.n_tokens, tiny_engine.runner.shape
    torch.manual_seed(2)
    q = torch.randn(shape.n_heads, n, shape.head_dim)  # [Hq, N, D]
    k, v = torch.randn(2, shape.n_kv_heads, n, shape.head_dim)  # [H, N, D] each
    noise = torch.randn_like(k)
    noise = noise / noise.norm(dim=(0, 2), keepdim=True)  # every token deviates by exactly 1
    K = k + noise  # [H, N, D] cached keys
    ratio = 0.2
    n_keep = math.ceil(ratio * len(rank.compete))
    mass = rank._attention_mass(q, k, K, None)[rank.compete]  # [P]
    expected = set(rank.compete[torch.topk(mass, n_keep).indices].tolist()) | set(rank.always.tolist())
    got = rank.select(q, k, v, K, v, ratio, plain_policy(metric="k", query_weighted=True), None)
    assert set(got.tolist()) == expected
    # unweighted, a token the question ignores competes on deviation alone
    K2 = K.clone()
    quiet = int(rank.compete[torch.argmin(mass)])
    K2[:, quiet] += 10.0
    plain = rank.select(q, k, v, K2, v, ratio, plain_policy(metric="k"), None)
    assert quiet in plain.tolist()


def test_epic_sinks_are_always_recomputed(tiny_engine):
    _cache_all(tiny_engine)
    policy = plain_policy(use_deviation=False, sink_tokens=3)
    st = tiny_engine.prefill(BlendPlan(PASSAGES, QUESTION, recompute_ratio=0.15, policy=policy))
    chosen = set(st.report.recomputed_positions)
    for seg in st.layout.segments:
        if seg.kind == "passage":
            assert {seg.offset, seg.offset + 1, seg.offset + 2} <= chosen
            assert seg.offset + 3 not in chosen


# ---------------------------------------------------------------------- RoPE
def test_rotation_composes(tiny_engine):
    r = tiny_engine.runner
    k = torch.randn(r.shape.n_kv_heads, 7, r.shape.head_dim)  # [H, T, D]
    two_steps = r.rotate_keys(r.rotate_keys(k, 13), 29)
    assert torch.allclose(two_steps, r.rotate_keys(k, 42), atol=1e-5)


@pytest.mark.slow
@torch.inference_mode()
def test_chunk_moved_to_p_matches_layer0_keys_prefilled_at_p(real_runner):
    r = real_runner
    engine = _engine(r)
    ids = engine.passage_tokens(PASSAGES[2])
    alone = engine.precompute(ids)  # positions 0..T-1
    p = 517
    hidden = r.embed(torch.tensor(ids))  # [T, E]
    cos, sin = r.rope(torch.arange(p, p + len(ids)))
    _, k_at_p, v_at_p = r.qkv(0, hidden, cos, sin)  # [H, T, D]
    moved = r.rotate_keys(alone.k[0], p)
    assert torch.allclose(moved, k_at_p, atol=1e-3, rtol=1e-3)
    assert (moved - k_at_p).abs().max() < 0.05 * (k_at_p - r.rotate_keys(alone.k[0], p + 1)).abs().max()
    assert torch.allclose(alone.v[0], v_at_p, atol=1e-5)


# ---------------------------------------------------------------------- generation
def test_generation_after_blend_equals_full_prefill_at_ratio_one(tiny_engine):
    _cache_all(tiny_engine)
    cfg = GenerationConfig(max_tokens=6)
    full = tiny_engine.run(BlendPlan(PASSAGES, QUESTION, mode="full_prefill"), cfg)
    blend = tiny_engine.run(BlendPlan(PASSAGES, QUESTION, recompute_ratio=1.0), cfg)
    assert len(full.token_ids) > 0
    assert blend.token_ids == full.token_ids


def test_streaming_deltas_concatenate_to_the_answer(tiny_engine):
    gen = tiny_engine.generate(BlendPlan(PASSAGES, QUESTION), GenerationConfig(max_tokens=5))
    text = "".join(gen)
    assert gen.result is not None and text == gen.result.text
    assert gen.result.ttft_ms <= gen.result.total_ms


def test_sampling_is_reproducible_with_a_seed_and_top_p_restricts():
    logits = torch.tensor([5.0, 4.9, 0.0, -3.0])
    a = [Sampler(1.0, 1.0, seed=7)(logits) for _ in range(1)]
    b = [Sampler(1.0, 1.0, seed=7)(logits) for _ in range(1)]
    assert a == b
    s = Sampler(1.0, 0.5, seed=1)
    assert {s(logits) for _ in range(50)} <= {0, 1}
    assert Sampler(0.0)(logits) == 0


def test_stream_decoder_cuts_at_stop_string(tokenizer):
    dec = StreamDecoder(tokenizer, stop=("\n",))
    out, hit = "", False
    for tid in tokenizer.encode("Berlin\nmore text", add_special_tokens=False):
        delta, hit = dec.push(tid)
        out += delta
        if hit:
            break
    assert hit and out == "Berlin" and dec.text == "Berlin"


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(passages=(), question="q"), "at least one passage"),
        (dict(passages=("p",), question="q", mode="turbo"), "unknown mode"),
        (dict(passages=("p",), question="q", recompute_ratio=1.5), "within [0, 1]"),
        (dict(passages=("p",), question="q", recompute_ratio=-0.1), "within [0, 1]"),
        (dict(passages=("p",), question="  "), "question"),
    ],
)
def test_bad_plans_raise_clear_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        BlendPlan(**kwargs)


def test_prompt_longer_than_context_is_refused(tiny_engine):
    long_passage = "word " * 1200
    with pytest.raises(ValueError, match="exceeds the model context"):
        tiny_engine.prefill(BlendPlan((long_passage,), QUESTION))
    with pytest.raises(ValueError, match="exceeds the model context"):
        tiny_engine.precompute(tiny_engine.passage_tokens(long_passage))


def test_unsupported_architecture_is_refused(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelRunner(model, tokenizer)


def test_mode_parse_accepts_enum_and_string():
    assert Mode.parse("prefix_cache") is Mode.PREFIX_CACHE
    assert Mode.parse(Mode.BLEND) is Mode.BLEND


def _poisoned_empty(fill: float):
    """torch.empty that hands back floating memory filled with `fill`, standing in for whatever an
    allocator or a reused buffer happens to hold."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(fill) if t.is_floating_point() else t
    return empty


@pytest.mark.parametrize("policy", [
    plain_policy(),  # "kv": normalised over the competing rows
    plain_policy(metric="k", query_weighted=True),
    plain_policy(metric="kv", query_weighted=True, check_multiplier=2.0, schedule=((2, 1.0),)),
    plain_policy(metric="kv", sink_tokens=2, schedule=((2, 1.0),)),
    plain_policy(metric="k", query_weighted=True, allocation="attention", check_multiplier=2.0, schedule=((2, 1.0),)),
], ids=["kv", "k-weighted", "kv-weighted-schedule", "kv-sinks-schedule", "k-weighted-by-attention"])
def test_blend_does_not_read_unfilled_cache_rows(tokenizer, monkeypatch, policy):
    """Uncached tokens (a missed passage, the question) have no cached K/V at the check layer: what
    the freshly allocated cache holds there must not change the selection or the logits."""
    engine = _engine(_tiny("llama", tokenizer))
    for p in (PASSAGES[0], PASSAGES[2]):  # PASSAGES[1] misses the cache
        engine.ensure_cached(p)
    plan = BlendPlan(PASSAGES[:3], QUESTION, recompute_ratio=0.3, policy=policy)
    runs = []
    for fill in (0.0, float("nan"), 1e30, -3.0, float("inf")):
        monkeypatch.setattr(torch, "empty", _poisoned_empty(fill))
        st = engine.prefill(plan)
        monkeypatch.undo()
        assert st.report.cache_misses >= 1
        runs.append((fill, st.report.recomputed_positions, st.logits))
    _, clean_positions, clean_logits = runs[0]
    for fill, positions, logits in runs[1:]:
        assert positions == clean_positions, f"selection changed with the cache's memory filled with {fill}"
        assert torch.equal(logits, clean_logits), f"logits changed with the cache's memory filled with {fill}"


def test_one_default_policy_everywhere():
    """The serving default is `SelectionPolicy()`: the engine's config, the prefill budget's estimate and
    the factory agree, and it differs from the ablation's plain single check (so the field defaults carry it)."""
    work = PrefillWork(n_tokens=10, n_cached=8, n_forced=2, n_layers=6, bytes_per_layer=1)
    assert SelectionPolicy() == default_policy() == EngineConfig().policy == work.policy
    assert SelectionPolicy() != plain_policy()


def test_placement_through_the_cpu_kernel_equals_torchs_bit_for_bit(tokenizer, monkeypatch):
    """`Placer` places float32 layers on the CPU with `cpu_kernels.place_rotated`: a blend around a miss
    (cached segments not contiguous) and a prefix-cache continuation (not rotated) give the same logits
    and caches as torch's rotation and copies."""
    from blend_engine.executor import placement
    from blend_engine.model import cpu_kernels

    assert cpu_kernels.ensure(), cpu_kernels.why_not()
    engine = _engine(_tiny("llama", tokenizer), kv_format="fp16")
    for p in (PASSAGES[0], PASSAGES[2]):  # PASSAGES[1] misses
        engine.ensure_cached(p)
    plans = (BlendPlan(PASSAGES[:3], QUESTION), BlendPlan(PASSAGES[::2], QUESTION, mode="prefix_cache"))
    calls = []
    real = cpu_kernels.place_rotated
    monkeypatch.setattr(cpu_kernels, "place_rotated", lambda *a: calls.append(1) or real(*a))
    with_kernel = [engine.prefill(p) for p in plans]
    assert calls
    monkeypatch.setattr(placement.Placer, "_takes", lambda self, k, v: False)
    without = [engine.prefill(p) for p in plans]
    for a, b in zip(with_kernel, without):
        assert torch.equal(a.logits, b.logits)
        assert all(torch.equal(x[:, :a.cache.length], y[:, :b.cache.length]) for x, y in zip(a.cache.k, b.cache.k))
