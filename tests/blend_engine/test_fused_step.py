"""One batch per step (issue #35 item 4): the decode rows and the rows of every prefill at a layer
go through one projection and one MLP call (`layers.layer_pass`), each group attending on its own.
On the tiny random Llama (fp32): a layer pass over several groups gives each what it gives alone;
in the engine loop several prefills advance in the same step beside the decode rows and every
request ends with its tokens alone; the step's prefill budget is shared as documented."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.decode import decode_batch, eager_rows, written
from blend_engine.executor.layers import KVCache, layer_pass
from blend_engine.kv_store import MemoryStore
from blend_engine.scheduler.batch import BatchLimits, PrefillBudget
from blend_engine.types import BlendPlan, GenerationConfig, Mode
from tests.helpers import PASSAGES, QUESTION, held_loop, poll

GEN = GenerationConfig(max_tokens=10, ignore_eos=True)


def _engine(runner, prefill_step_tokens: int = 4096, prefix_caching: bool = True) -> BlendEngine:
    limits = BatchLimits(max_batch=8, kv_budget_bytes=64 << 20, prefill_step_tokens=prefill_step_tokens)
    return BlendEngine(runner, MemoryStore(1 << 28), EngineConfig(batch=limits, prefix_caching=prefix_caching))


def _plan(i: int, mode: Mode = Mode.BLEND) -> BlendPlan:
    docs = tuple(PASSAGES[(i + j) % len(PASSAGES)] for j in range(2 + i % 3))
    return BlendPlan(docs, f"{QUESTION} ({i})", mode=mode, recompute_ratio=0.3)


def _warm(engine: BlendEngine, plan: BlendPlan) -> None:
    for seg in engine.layout(plan).segments[:-1]:
        engine.cache_ids(seg.token_ids, plan.cache_salt)


def _first_decoding(eng: BlendEngine, plans: list[BlendPlan], out: list, gen: GenerationConfig,
                    steps: int) -> tuple[Callable[[int, GenerationConfig], None], threading.Thread]:
    """Plans' passages stored, then plan 0 running on a thread until it decoded `steps` tokens; `one(i,
    gen)` runs plan i into `out[i]` (its token ids)."""
    for p in plans:
        _warm(eng, p)

    def one(i: int, g: GenerationConfig) -> None:
        out[i] = eng.run(plans[i], g).token_ids

    first = threading.Thread(target=one, args=(0, gen))
    first.start()
    poll(lambda: eng.loop.stats()["decode_steps"] >= steps)
    return one, first


def _copy(cache: KVCache) -> KVCache:
    out = KVCache.over([k.clone() for k in cache.k], [v.clone() for v in cache.v], cache.capacity)
    out.length = cache.length
    return out


@pytest.fixture(scope="module")
def runner(tiny_runner):
    return tiny_runner


def test_one_layer_pass_over_several_groups_gives_each_what_it_gives_alone(runner):
    eng = _engine(runner)
    try:
        plans = [_plan(0), _plan(1, Mode.FULL_PREFILL)]
        for p in plans:
            _warm(eng, p)
        alone = [eng.prefill(p, 4) for p in plans]
        decoding = eng.prefill(_plan(2, Mode.FULL_PREFILL), 4).cache  # a sequence that decodes
        twin = _copy(decoding)
        tok, pos = 42, decoding.length
        decode_alone = decode_batch(runner, [twin], [tok], [pos])  # [1, V]

        with torch.inference_mode():  # as on the engine loop's thread
            preps = [eng.prepare(p, 4) for p in plans]
            runs = [eng.start_run(p, prep, 4) for p, prep in zip(plans, preps)]
            rows = eager_rows(runner, [decoding], [tok], [pos])
            for layer in range(runner.shape.n_layers):
                layer_pass(runner, layer, [rows] + [run.enter() for run in runs])  # | decode | blend | full |
                for run in runs:
                    run.leave()
            decode_fused = rows.logits()  # [1, V]
            written([decoding], [pos])
            fused = [eng.complete_run(p, prep, run) for p, prep, run in zip(plans, preps, runs)]
    finally:
        eng.close()
    assert alone[0].report.recomputed_tokens < alone[0].layout.n_tokens  # the blend selected rows
    for a, f in zip(alone, fused):
        assert f.report.recomputed_positions == a.report.recomputed_positions
        torch.testing.assert_close(f.logits, a.logits, atol=1e-4, rtol=1e-4)
        n = a.layout.n_tokens
        for layer in range(runner.shape.n_layers):
            torch.testing.assert_close(f.cache.k[layer][:, :n], a.cache.k[layer][:, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode_fused, decode_alone, atol=1e-4, rtol=1e-4)
    assert decoding.length == twin.length == pos + 1
    for layer in range(runner.shape.n_layers):
        torch.testing.assert_close(decoding.v[layer][:, pos], twin.v[layer][:, pos], atol=1e-5, rtol=1e-5)


def test_several_prefills_advance_in_one_step_beside_the_decode_rows(runner):
    plans = [_plan(3), _plan(4), _plan(5, Mode.FULL_PREFILL)]
    long_gen = GenerationConfig(max_tokens=80, ignore_eos=True)
    alone = []
    for p, g in zip(plans, (long_gen, GEN, GEN)):
        eng = _engine(runner)
        try:
            _warm(eng, p)
            alone.append(eng.run(p, g).token_ids)
        finally:
            eng.close()

    eng = _engine(runner, prefill_step_tokens=1_000_000)  # both prefills allotted whole steps
    out: list = [None] * 3
    try:
        one, first = _first_decoding(eng, plans, out, long_gen, steps=1)
        with held_loop(eng.loop):  # the next two arrive in the same step
            rest = [threading.Thread(target=one, args=(i, GEN)) for i in (1, 2)]
            for t in rest:
                t.start()
            poll(lambda: eng.loop.stats()["waiting"] >= 2)
        for t in [first, *rest]:
            t.join(60)
        stats = eng.loop.stats()
    finally:
        eng.close()
    assert out == alone
    assert stats["max_prefills_seen"] == 2
    assert stats["fused_steps"] >= 1  # their layers beside the decoding request


def test_the_prefill_budget_goes_to_the_oldest_first_and_the_rest_to_the_younger():
    unbounded = PrefillBudget(None)
    unbounded.allot(1, 10, 1)
    assert all(unbounded.take(1, 10_000) for _ in range(50))
    b = PrefillBudget(100)
    b.allot(1, 35, 2)  # the oldest could use 70 at most: it gets them
    b.allot(2, 100, 5)  # the next gets the 30 left
    b.allot(3, 100, 5)  # nothing left: it waits for the next step
    assert b.take(1, 30) and b.take(2, 20) and b.take(1, 30) and b.take(2, 20)  # 2 crosses its 30 here
    assert not b.take(2, 20) and not b.take(3, 1)
    assert b.take(1, 30) and not b.take(1, 30)  # 1 crosses its 70 on its third layer


def test_each_layer_a_prefill_enters_costs_its_rows_plus_the_overhead():
    """Short prefills (exact repeats computing their last tokens) cost mostly their per-layer overhead:
    eight of 10 rows fit a budget of 2,000 over 30 layers when rows alone count, three with 12 more a layer."""
    def layers_run(overhead: int) -> list[int]:
        b = PrefillBudget(2000, overhead)
        for rid in range(8):
            b.allot(rid, 10, 30)
        return [sum(b.take(rid, 10) for _ in range(30)) for rid in range(8)]

    assert layers_run(0) == [30] * 6 + [20, 0]  # 300 each: six whole, the seventh 20 layers of the 200 left
    assert layers_run(12) == [30, 30, 30, 1, 0, 0, 0, 0]  # 660 each: three whole, the fourth crosses its 20 at once


def test_the_loop_counts_each_prefill_row_at_every_layer_it_enters(runner):
    """`prefill_token_layers` (the budget's unit, /metrics' prefill work): a full prefill enters every
    layer with all its rows; a blend all of them up to its check layer, then only the selected ones."""
    layers = runner.shape.n_layers
    for mode in (Mode.FULL_PREFILL, Mode.BLEND):
        eng = _engine(runner, prefix_caching=False)  # no prefix hit: every row is computed
        try:
            plan = _plan(0, mode)
            _warm(eng, plan)
            n = eng.layout(plan).n_tokens
            eng.run(plan, GEN)
            counted = eng.loop.stats()["prefill_token_layers"]
            check = eng.config.policy.check_layer
        finally:
            eng.close()
        if mode is Mode.FULL_PREFILL:
            assert counted == n * layers
        else:
            assert n * (check + 1) + (layers - check - 1) <= counted < n * layers


def test_a_time_target_learned_from_the_steps_splits_a_prefill_and_changes_no_token(runner):
    """With a target no step can meet, each step beside the decoding request carries one layer of
    the new prefill (budget 1 unit, learned from the loop's own steps); tokens as alone."""
    plans = [_plan(0, Mode.FULL_PREFILL), _plan(1)]
    long_gen = GenerationConfig(max_tokens=400, ignore_eos=True)  # decodes until both others are done
    eng = _engine(runner)
    try:
        for p in plans:
            _warm(eng, p)
        alone = [eng.run(plans[0], long_gen).token_ids, eng.run(plans[1], GEN).token_ids]
    finally:
        eng.close()
    limits = BatchLimits(max_batch=8, kv_budget_bytes=64 << 20, prefill_step_s=1e-9, prefill_layer_overhead=100)
    eng = BlendEngine(runner, MemoryStore(1 << 28), EngineConfig(batch=limits, prefix_caching=False))
    out: list = [None, None]
    try:
        one, first = _first_decoding(eng, plans, out, long_gen, steps=2)
        one(1, GEN)  # a probe step beside the decoding request (its cost measured), then a layer a step
        fused = eng.loop.stats()["fused_steps"]
        again = eng.run(plans[1], GEN).token_ids  # now a layer a step
        first.join(60)
        step_time, stats = eng.loop.scheduler.step_time, eng.loop.stats()
    finally:
        eng.close()
    assert out == alone and again == alone[1]
    assert step_time.decode_s is not None and step_time.unit_s is not None and step_time.units(4096) == 1
    assert fused == runner.shape.n_layers and stats["fused_steps"] == 2 * runner.shape.n_layers
