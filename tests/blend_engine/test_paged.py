"""The paged KV pool in the engine loop, on the tiny random Llama (greedy, fp32): automatic prefix
caching gives the same tokens as computing the prompt, never across tenants; a pool far too small
for the load preempts and every request still ends with its tokens alone; nothing leaks; a request
that cannot fit the pool is refused before admission; a seeded schedule of mixed modes arriving at
random times gives every request its tokens alone."""

from __future__ import annotations

import random
import threading
import time

import pytest

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.errors import InputError
from blend_engine.kv_store import MemoryStore
from blend_engine.scheduler.batch import BatchLimits
from blend_engine.types import BlendPlan, GenerationConfig, Mode
from tests.helpers import poll, run_threads

PASSAGES = [f"Passage {i}: the river {w} flows past {i * 7} old mills and a bridge named {w.upper()}."
            for i, w in enumerate(["Arno", "Tiber", "Po", "Adige", "Brenta", "Piave"])]
GEN = GenerationConfig(max_tokens=12, ignore_eos=True)


def _engine(runner, pool_tokens: int | None = None, max_batch: int = 8, decode_attention: str = "auto") -> BlendEngine:
    bt = 16
    per_token = 2 * runner.shape.n_layers * runner.shape.n_kv_heads * runner.shape.head_dim * runner.dtype.itemsize
    budget = (pool_tokens or 1 << 16) * per_token
    limits = BatchLimits(max_batch=max_batch, kv_budget_bytes=budget, prefill_step_tokens=64, block_tokens=bt)
    return BlendEngine(runner, MemoryStore(1 << 28), EngineConfig(batch=limits, decode_attention=decode_attention))


def _plan(i: int, mode: Mode = Mode.BLEND, salt: str | None = None) -> BlendPlan:
    k = 2 + i % 3
    docs = tuple(PASSAGES[(i + j) % len(PASSAGES)] for j in range(k))
    return BlendPlan(docs, f"Which mill is number {i}?", mode=mode, recompute_ratio=0.3, cache_salt=salt)


@pytest.fixture(scope="module")
def runner(tiny_runner):
    return tiny_runner


def _warm(engine: BlendEngine, plans: list[BlendPlan]) -> None:
    for p in plans:
        for seg in engine.layout(p).segments[:-1]:
            engine.cache_ids(seg.token_ids, p.cache_salt)


def _alone(runner, plans: list[BlendPlan], gen: GenerationConfig = GEN) -> list[tuple[int, ...]]:
    """Each plan on a fresh engine of its own (no prefix cached, nothing else running)."""
    out = []
    for p in plans:
        eng = _engine(runner)
        try:
            _warm(eng, [p])
            out.append(eng.run(p, gen).token_ids)
        finally:
            eng.close()
    return out


def _together(engine: BlendEngine, plans: list[BlendPlan], delays: list[float] | None = None,
              gen: GenerationConfig = GEN) -> list:
    out: list = [None] * len(plans)

    def one(i: int) -> None:
        if delays:
            time.sleep(delays[i])  # arrival times only: no assertion depends on them
        out[i] = engine.run(plans[i], gen).token_ids

    run_threads(one, len(plans))
    return out


def _pool_is_empty(engine: BlendEngine) -> bool:
    st = engine.loop.stats()
    return st["kv_blocks_in_use"] == 0 and st["running"] == 0 and st["waiting"] == 0


@pytest.mark.parametrize("mode", [Mode.FULL_PREFILL, Mode.BLEND, Mode.FULL_REUSE, Mode.PREFIX_CACHE])
def test_an_exact_repeat_takes_the_cached_prefix_and_gives_the_same_tokens(runner, mode):
    eng = _engine(runner)
    try:
        p = _plan(4, mode)
        _warm(eng, [p])
        first = eng.run(p, GEN)
        again = eng.run(p, GEN)
        n = eng.layout(p).n_tokens
        assert first.report.prefix_tokens_reused < again.report.prefix_tokens_reused
        assert again.report.prefix_tokens_reused == (n - 1) // 16 * 16  # every full block but the last token's
        assert again.report.recomputed_tokens == n - again.report.prefix_tokens_reused
        assert again.token_ids == first.token_ids
        assert _pool_is_empty(eng)
    finally:
        eng.close()


def test_a_prefix_hit_never_crosses_tenants_and_blend_never_takes_reused_kv(runner):
    eng = _engine(runner)
    try:
        a, b = _plan(1, salt="tenant-a"), _plan(1, salt="tenant-b")
        _warm(eng, [a, b])
        eng.run(a, GEN)
        assert eng.run(b, GEN).report.prefix_tokens_reused == 0
        reuse = _plan(2, Mode.FULL_REUSE)
        _warm(eng, [reuse])
        eng.run(reuse, GEN)
        assert eng.run(_plan(2, Mode.BLEND), GEN).report.prefix_tokens_reused == 0
        assert eng.run(_plan(2, Mode.FULL_PREFILL), GEN).report.prefix_tokens_reused == 0
    finally:
        eng.close()


@pytest.mark.parametrize("decode_attention", ["auto", "pooled"])
def test_a_pool_far_too_small_preempts_and_every_request_ends_as_alone(runner, decode_attention):
    plans = [_plan(i) for i in range(6)]
    gen = GenerationConfig(max_tokens=64, ignore_eos=True)  # 4 blocks of growth each
    alone = _alone(runner, plans, gen)
    longest = max(_engine(runner).layout(p).n_tokens for p in plans)
    # any two prompts fit at admission, with at most 6 blocks to spare: two of them cannot both grow
    eng = _engine(runner, pool_tokens=2 * -(-(longest + 1) // 16) * 16, decode_attention=decode_attention)
    try:
        _warm(eng, plans)
        got = _together(eng, plans, gen=gen)
        assert got == alone
        assert eng.loop.scheduler.preemptions > 0
        assert _pool_is_empty(eng)
    finally:
        eng.close()


def test_a_seeded_schedule_of_mixed_modes_gives_each_request_its_tokens_alone(runner):
    rng = random.Random(7)
    modes = [Mode.BLEND, Mode.FULL_PREFILL, Mode.FULL_REUSE, Mode.PREFIX_CACHE]
    plans = [_plan(rng.randrange(6), rng.choice(modes)) for _ in range(10)]
    alone = _alone(runner, plans)
    eng = _engine(runner, pool_tokens=900)
    try:
        _warm(eng, plans)
        got = _together(eng, plans, delays=[rng.random() * 0.5 for _ in plans])
        assert got == alone
        assert _pool_is_empty(eng)
    finally:
        eng.close()


def test_cancelled_and_failed_requests_give_their_blocks_back(runner):
    eng = _engine(runner)
    try:
        p = _plan(3)
        _warm(eng, [p])
        g = eng.generate(p, GenerationConfig(max_tokens=50, ignore_eos=True))
        it = iter(g)
        next(it)
        it.close()  # the client left after one delta
        deadline = time.monotonic() + 30
        while not _pool_is_empty(eng) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _pool_is_empty(eng)
    finally:
        eng.close()


def test_a_request_that_cannot_fit_the_pool_is_refused_before_admission(runner):
    eng = _engine(runner, pool_tokens=64)
    try:
        with pytest.raises(InputError, match="KV pool"):
            eng.run(_plan(0), GenerationConfig(max_tokens=8))
        assert _pool_is_empty(eng)
    finally:
        eng.close()


def test_with_prefix_caching_off_every_request_computes_its_whole_prompt(runner):
    eng = BlendEngine(runner, MemoryStore(1 << 28), EngineConfig(prefix_caching=False))
    try:
        p = _plan(5, Mode.FULL_PREFILL)
        first, again = eng.run(p, GEN), eng.run(p, GEN)
        assert again.report.prefix_tokens_reused == 0 and again.token_ids == first.token_ids
    finally:
        eng.close()


def test_the_pool_settings_reach_the_engine(runner):
    from blend_engine.executor.kv_pool import block_bytes
    from blendserve_config.settings import Settings
    from blendserve_config.stack import build_engine

    settings = Settings(_env_file=None, kv_block_tokens=8, prefix_caching=False, batch_kv_mb=1, max_batch=3)
    eng = build_engine(settings, runner, MemoryStore(1 << 20))
    try:
        assert eng.config.batch.block_tokens == 8 and eng.config.batch.max_batch == 3
        assert not eng.config.prefix_caching
        assert eng.loop.scheduler.pool.n_blocks == (1 << 20) // block_bytes(runner, 8)
    finally:
        eng.close()


def test_prefix_caching_off_still_serves_prefix_cache_mode_from_the_pool(runner):
    """prefix_cache mode is the pool's prefix cache: switching automatic prefix caching off for the other
    modes (benchmarks comparing modes on one prompt) leaves that mode its hits."""
    eng = BlendEngine(runner, MemoryStore(1 << 28), EngineConfig(prefix_caching=False))
    try:
        p = _plan(5, Mode.PREFIX_CACHE)
        first, again = eng.run(p, GEN), eng.run(p, GEN)
        assert first.report.prefix_tokens_reused == 0 and again.report.prefix_tokens_reused > 0
        assert again.token_ids == first.token_ids
    finally:
        eng.close()


def test_an_unset_pool_size_comes_from_available_memory_within_bounds(runner, monkeypatch, tmp_path):
    """BLENDSERVE_ENGINE_BATCH_KV_MB unset: on the CPU 30% of the memory available after the model, less the
    memory tier, clamped to 256..8192 blocks; a container's cgroup limit bounds what is available."""
    import torch

    from blend_engine.executor import kv_pool
    from blendserve_config.settings import Settings
    from blendserve_config.stack import build_engine

    bb = kv_pool.block_bytes(runner, 16)
    cpu = torch.device("cpu")
    monkeypatch.setattr(kv_pool, "available_memory", lambda: 1000 * bb + (1 << 30))
    assert kv_pool.pool_bytes(cpu, None, None, bb, set_aside=1 << 30) == int(1000 * bb * 0.3)
    assert kv_pool.pool_bytes(cpu, 5 << 20, 0.5, bb) == 5 << 20  # set: as set (the GPU share is for CUDA)
    monkeypatch.setattr(kv_pool, "available_memory", lambda: 0)
    assert kv_pool.pool_bytes(cpu, None, None, bb) == 256 * bb
    monkeypatch.setattr(kv_pool, "available_memory", lambda: 1 << 50)
    assert kv_pool.pool_bytes(cpu, None, None, bb) == 8192 * bb
    monkeypatch.setattr(kv_pool, "available_memory", lambda: 2000 * bb + (1 << 20))
    eng = build_engine(Settings(_env_file=None, memory_cache_mb=1), runner, MemoryStore(1 << 20))
    try:
        assert eng.loop.scheduler.pool.n_blocks == (int(2000 * bb * 0.3) >> 20 << 20) // bb
    finally:
        eng.close()
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("400\n")
    assert kv_pool._cgroup_headroom(str(tmp_path)) == 600
    (tmp_path / "memory.max").write_text("max\n")
    assert kv_pool._cgroup_headroom(str(tmp_path)) is None
    assert kv_pool._cgroup_headroom(str(tmp_path / "absent")) is None


def test_storing_missed_passages_waits_for_nothing_and_interleaves_with_the_batch(runner):
    """A finished request's result is handed over at once; the alone-KV of its passages that missed
    the store is stored afterwards, a layer a background unit, so a running request decodes between
    them (the batch never stalls for the whole store, nor for one passage)."""
    engine = _engine(runner)
    try:
        busy = _plan(0)
        _warm(engine, [busy])
        cold = BlendPlan(tuple(f"Cold note {i}: the ferry {w} leaves at {i + 5} and stops at the {w} pier."
                               for i, w in enumerate(["Alba", "Bora", "Cima"])), "When does Bora leave?",
                         recompute_ratio=0.3)
        keys = [engine.chunks.key_of(s.token_ids, None) for s in engine.layout(cold).segments[1:-1]]
        at_steps: list[int] = []  # the loop's decode steps at each unit of storing
        store = engine.chunks.store_steps
        release = threading.Event()

        def recording(token_ids, salt=None):
            release.wait(60)  # held until the result is out: storing runs after the answer
            steps = store(token_ids, salt)
            while True:
                at_steps.append(engine.loop.steps)
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
                yield

        engine.chunks.store_steps = recording
        decoding = threading.Event()
        busy_tokens: list = []

        def run_busy() -> None:
            g = engine.generate(busy, GenerationConfig(max_tokens=60, ignore_eos=True))
            for _ in g.deltas():
                decoding.set()
            busy_tokens.append(g.result.token_ids)

        t = threading.Thread(target=run_busy)
        t.start()
        assert decoding.wait(60)
        result = engine.run(cold, GenerationConfig(max_tokens=1, ignore_eos=True))
        assert len(keys) == 3 and not any(engine.store.contains(k) for k in keys)  # the answer did not wait
        assert result.store_ms == 0
        release.set()
        poll(lambda: all(engine.store.contains(k) for k in keys))
        t.join(60)
        assert len(busy_tokens[0]) == 60
        assert len(at_steps) == 3 * runner.shape.n_layers
        if at_steps[0] < engine.loop.steps:  # the busy request still decoded when storing began
            assert len(set(at_steps)) > 1, at_steps  # ... and decoded between units
        assert engine.loop.stats()["store_done"] == 3
    finally:
        engine.close()


def test_a_request_needing_a_queued_passage_stores_it_first_and_loads_it(runner):
    """A passage still queued for storing is stored (once) before a request that misses it is
    planned: that request loads it (a hit), it is not computed twice."""
    engine = _engine(runner)
    try:
        plan = BlendPlan(("Queued note: the lighthouse keeper is Ines.", "Another note: the bell rings at 9."),
                         "Who keeps the lighthouse?", recompute_ratio=0.3)
        stored = _count_stores(engine)
        engine.loop.storing.paused = True  # no background unit stores them before the second request
        first = engine.run(plan, GenerationConfig(max_tokens=1))
        misses = first.report.cache_misses  # its passages (and the system prompt, on a fresh store)
        assert misses >= 2 and stored == []
        again = engine.run(BlendPlan(plan.passages[::-1], plan.question, recompute_ratio=0.3),
                           GenerationConfig(max_tokens=1))
        # the system prompt lies in the cached prefix the second request takes: it stays queued
        assert again.report.cache_hits >= 2 and again.report.cache_misses <= 1
        assert len(stored) + again.report.cache_misses == misses  # each stored once, before it was planned again
    finally:
        engine.close()


def test_an_exact_repeat_takes_its_queued_passages_from_the_pool_without_waiting_for_them(runner):
    """Issue #56: the same inline-documents prompt again, while the first one's passages still wait to be
    stored: its KV is in the pool (a prefix hit), so it does not store them first (on 2 cores that took
    14-40 s for 20 passages); they stay queued for the background."""
    engine = _engine(runner)
    try:
        plan = BlendPlan(tuple(PASSAGES[:4]), "Which bridge is named TIBER?", recompute_ratio=0.3)
        stored = _count_stores(engine)
        engine.loop.storing.paused = True  # no background unit stores them between the two requests
        first = engine.run(plan, GenerationConfig(max_tokens=4, ignore_eos=True))
        misses = first.report.cache_misses
        assert misses >= 4 and stored == []
        again = engine.run(plan, GenerationConfig(max_tokens=4, ignore_eos=True))
        assert again.report.prefix_tokens_reused > 0 and again.token_ids == first.token_ids
        assert len(stored) < misses  # the passages inside the taken prefix were not stored first
        assert engine.loop.stats()["store_queued"] == misses - len(stored)  # still queued for the background
        engine.loop.storing.paused = False
        engine.loop.wake()
        poll(lambda: engine.loop.stats()["store_queued"] == 0)
        assert len(stored) == misses  # each stored once in all
    finally:
        engine.close()


def _count_stores(engine) -> list[str]:
    """Record each passage the engine starts storing (its key), through the chunk cache's stepped store."""
    stored: list[str] = []
    store = engine.chunks.store_steps

    def counting(token_ids, salt=None):
        stored.append(engine.chunks.key_of(token_ids, salt))
        return store(token_ids, salt)

    engine.chunks.store_steps = counting
    return stored


def test_a_full_prefill_answer_also_stores_its_new_passages(runner):
    """Served by full prefill (asked, or the fidelity gate's fallback), a request still leaves its
    new passages stored for later blends."""
    engine = _engine(runner)
    try:
        plan = BlendPlan(("Full note: the orchard has 40 trees.",), "How many trees?", mode=Mode.FULL_PREFILL)
        keys = [engine.chunks.key_of(s.token_ids, None) for s in engine.layout(plan).segments[1:-1]]
        engine.run(plan, GenerationConfig(max_tokens=1))
        poll(lambda: all(engine.store.contains(k) for k in keys))
        blend = engine.run(BlendPlan(plan.passages, plan.question, recompute_ratio=0.3), GenerationConfig(max_tokens=1))
        assert blend.report.cache_misses == 0
    finally:
        engine.close()


def test_evicted_prefix_blocks_are_counted(runner):
    """A pool too small to keep every finished prompt's blocks cached evicts the least recently used;
    the loop's stats (and so /metrics) count them."""
    engine = _engine(runner, pool_tokens=256)
    try:
        assert engine.loop.stats()["kv_blocks_evicted"] == 0
        for i in range(6):  # distinct prompts, each larger than a third of the pool
            engine.run(_plan(i, mode=Mode.FULL_PREFILL), GenerationConfig(max_tokens=1))
        evicted = engine.loop.stats()["kv_blocks_evicted"]
        assert evicted > 0 and evicted == engine.loop.scheduler.pool.evictions
    finally:
        engine.close()


def test_storing_waits_while_host_work_is_held_and_never_longer_than_the_bound(runner, monkeypatch):
    """Issue #56: while a query's host work is in flight (`Background.hold`), the loop stores nothing;
    the release wakes it. Held past MAX_HOLD_S, storing goes on anyway (the loop's wait times out)."""
    from blend_engine.loop import background

    engine = _engine(runner)
    try:
        plan = BlendPlan(tuple(PASSAGES[:3]), "Which bridge is named TIBER?", recompute_ratio=0.3)
        monkeypatch.setattr(background, "MAX_HOLD_S", 3600.0)
        engine.loop.background.hold()
        first = engine.run(plan, GenerationConfig(max_tokens=2, ignore_eos=True))
        assert first.report.cache_misses >= 3
        assert engine.loop.stats()["store_queued"] == first.report.cache_misses  # the answer went out; nothing stored
        engine.loop.background.release()
        poll(lambda: engine.loop.stats()["store_queued"] == 0)

        monkeypatch.setattr(background, "MAX_HOLD_S", 0.2)
        other = BlendPlan(tuple(PASSAGES[4:7]), "Which river?", recompute_ratio=0.3)
        engine.loop.background.hold()  # never released
        second = engine.run(other, GenerationConfig(max_tokens=2, ignore_eos=True))
        assert second.report.cache_misses > 0
        poll(lambda: engine.loop.stats()["store_queued"] == 0)  # stored in bounded waits, no deadlock
    finally:
        engine.close()
