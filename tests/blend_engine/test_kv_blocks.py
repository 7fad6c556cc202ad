"""The paged pool's bookkeeping alone (torch-free): runs, growth, preemption, automatic prefix
caching (in place and copied), eviction order, and the prefix rules per mode."""

from __future__ import annotations

import pytest

from blend_engine.scheduler.batch import BatchLimits, BatchScheduler, SeqSpec
from blend_engine.scheduler.kv_blocks import (
    BLEND,
    EXACT,
    BlockPool,
    Run,
    chain_hashes,
    chain_root,
    min_prefix,
    recipes,
)
from blend_engine.types import Mode


def _sched(n_blocks: int, max_batch: int = 8, bt: int = 4) -> BatchScheduler:
    return BatchScheduler(BatchLimits(max_batch=max_batch, prefill_step_tokens=100, block_tokens=bt), n_blocks, 1)


def _chain(tokens: list[int], recipe: str = EXACT, salt: str | None = None, bt: int = 4) -> tuple[str, ...]:
    return chain_hashes(chain_root("model", salt, recipe), tokens, bt)


def test_hash_chains_depend_on_every_earlier_token_the_salt_and_the_recipe():
    a = _chain(list(range(12)))
    assert len(a) == 3 and len(_chain(list(range(11)))) == 2  # full blocks only
    b = _chain([99, *range(1, 12)])
    assert all(x != y for x, y in zip(a, b))  # one token changed in block 0: every later hash differs
    assert _chain(list(range(12)), salt="t1")[0] != a[0]
    assert _chain(list(range(12)), recipe=BLEND)[0] != a[0]


def test_a_run_grows_in_place_then_moves_and_release_frees_everything():
    pool = BlockPool(6, 4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert (a, b) == (Run(0, 2), Run(2, 2)) and pool.in_use == 4
    grown, moved, _ = pool.grow(b)
    assert (grown, moved) == (Run(2, 3), False)  # block 4 was free
    assert pool.grow(Run(0, 2)) is None  # block 2 is b's, and no window of 3 is left
    for run in (a, grown):
        pool.release(run)
    assert pool.in_use == 0 and pool.free == 6


def test_a_run_that_can_only_grow_over_its_own_blocks_is_compacted():
    pool = BlockPool(5, 4)
    low = pool.allocate(2)
    high = pool.allocate_at(2, 3, keep=0)  # [2, 5): the end of the pool
    pool.release(low)  # alone now; nothing free after it, and no free window of 4 beside it
    new, moved, given_back = pool.grow(high)
    assert (new, moved, given_back) == (Run(0, 4), True, True) and pool.in_use == 4


def test_cached_prefix_is_adopted_in_place_or_copied_and_lru_is_evicted_first():
    s = _sched(8)
    toks = list(range(10))
    chain = _chain(toks)
    s.add(SeqSpec(0, 10, lookups=(chain,), own=chain))
    (adm,) = s.schedule().admit
    assert adm.prefix_tokens == 0 and adm.run == Run(0, 3)
    s.prefilled(0)  # blocks 0, 1 registered (2 full blocks of 10 tokens)
    s.finish(0)
    assert s.pool.cached == 2
    s.add(SeqSpec(1, 10, lookups=(chain,), own=chain))  # an exact repeat: adopted where it lies
    (adm,) = s.schedule().admit
    assert adm.run == Run(0, 3) and adm.prefix_tokens == 8 and adm.copy_from == ()
    s.prefilled(1)
    s.add(SeqSpec(2, 10, lookups=(chain,), own=chain))  # the same prompt while 1 runs: copied
    step = s.schedule()
    (adm,) = step.admit
    assert adm.prefix_tokens == 8 and adm.copy_from == (0, 1) and adm.run.start >= 3
    s.applied()
    assert s.pool.in_use == 6


def test_while_others_decode_prefix_copies_spend_the_step_budget_and_admission_stops_there():
    """Copying a cached prefix into a new run is prefill work: a burst of exact repeats beside a
    decoding request is admitted over several steps, not all in one long step."""
    limits = BatchLimits(max_batch=8, prefill_step_tokens=20, block_tokens=4, prefix_copy_cost=1.0)
    s = BatchScheduler(limits, 20, 1)
    chain = _chain(list(range(10)))
    s.add(SeqSpec(0, 10, lookups=(chain,), own=chain))
    s.schedule()
    s.prefilled(0)  # decoding from now on; its 2 full blocks are cached
    for rid in (1, 2, 3, 4):
        s.add(SeqSpec(rid, 10, lookups=(chain,), own=chain))
    step = s.schedule()
    assert [a.rid for a in step.admit] == [1, 2, 3]  # 8 tokens copied each: 20 -> 12 -> 4 -> -4
    assert all(a.copy_from == (0, 1) for a in step.admit)
    assert step.held == (4, "waited_step_budget") and step.prefill == () and step.decode == (0,)
    s.applied()
    step = s.schedule()
    assert [a.rid for a in step.admit] == [4] and step.prefill_tokens == 12 and step.prefill == (1, 2, 3, 4)


def test_with_nothing_decoding_admission_ignores_the_step_budget():
    limits = BatchLimits(max_batch=8, prefill_step_tokens=1, block_tokens=4, prefix_copy_cost=1.0)
    s = BatchScheduler(limits, 20, 1)
    chain = _chain(list(range(10)))
    s.add(SeqSpec(0, 10, lookups=(chain,), own=chain))
    s.schedule()
    s.prefilled(0)
    s.finish(0)  # cached, nothing running
    for rid in (1, 2, 3):
        s.add(SeqSpec(rid, 10, lookups=(chain,), own=chain))
    step = s.schedule()
    assert [a.rid for a in step.admit] == [1, 2, 3] and step.prefill_tokens is None and step.prefill == (1,)


def test_prompts_sharing_a_first_block_each_repeat_in_place():
    """Two prompts open with the same block (a system prompt): each keeps a consecutive chain of its
    own, and the block after it (its tail) is left for its repeat, so both repeats adopt in place."""
    s = _sched(20)
    a = list(range(10))
    b = [0, 1, 2, 3, *range(50, 56)]  # block 0 as a's
    chain_a, chain_b = _chain(a), _chain(b)
    assert chain_a[0] == chain_b[0] and chain_a[1] != chain_b[1]
    for rid, chain in ((0, chain_a), (1, chain_b)):  # blend-like: only a prefix of both blocks is taken
        s.add(SeqSpec(rid, 10, lookups=(chain,), own=chain, min_hit=8))
        (adm,) = s.schedule().admit
        assert adm.prefix_tokens == 0
        s.prefilled(rid)
        s.finish(rid)
    assert s.pool.cached == 4  # a's 2 blocks, b's 2 (its first names the same tokens as a's)
    for rid, chain, start in ((2, chain_a, 0), (3, chain_b, 3)):  # b was placed after a's tail (block 2)
        s.add(SeqSpec(rid, 10, lookups=(chain,), own=chain, min_hit=8))
        (adm,) = s.schedule().admit
        assert adm.prefix_tokens == 8 and adm.copy_from == () and adm.run == Run(start, 3)
        s.prefilled(rid)
        s.finish(rid)


def test_a_new_run_takes_a_chain_tail_only_when_no_free_window_is_left():
    pool = BlockPool(6, 4)
    a = pool.allocate(3)
    pool.register(a, ["h0", "h1"])  # block 2 is a's tail
    pool.release(a)
    assert pool.allocate(2) == Run(3, 2)  # blocks 3-4: free, not a's tail
    assert pool.allocate_at(0, 3, keep=2) == Run(0, 3)  # a's repeat: its blocks and its tail, in place
    assert pool.cached == 0 and pool.evictions == 0  # the tail was overwritten, not counted as an eviction


def test_a_prefix_below_min_hit_is_not_taken():
    s = _sched(8)
    chain = _chain(list(range(10)))
    s.add(SeqSpec(0, 10, lookups=(chain,), own=chain))
    s.schedule()
    s.prefilled(0)
    s.finish(0)
    s.add(SeqSpec(1, 10, lookups=(chain,), own=chain, min_hit=12))
    (adm,) = s.schedule().admit
    assert adm.prefix_tokens == 0


def test_the_youngest_is_preempted_when_a_decoding_run_cannot_grow_and_comes_back_first():
    s = _sched(4, bt=4)
    s.add(SeqSpec(0, 7))  # 2 blocks
    s.add(SeqSpec(1, 7))  # 2 blocks: the pool is full
    s.schedule()
    s.prefilled(0)
    s.schedule()  # 0 decodes position 7 (its 8th slot), 1 prefills
    s.prefilled(1)
    step = s.schedule()  # 0 needs a 3rd block for position 8: 1 (the youngest) is preempted
    assert step.preempt == (1,) and step.decode == (0,) and s.preemptions == 1
    assert s.waiting == 1 and s.running == 1
    s.finish(0)
    (adm,) = s.schedule().admit
    assert adm.rid == 1 and adm.prefix_tokens == 0  # recomputed from its prompt


def test_prefix_rules_per_mode():
    assert recipes(Mode.FULL_PREFILL) == ((EXACT,), EXACT)
    assert recipes(Mode.BLEND) == ((EXACT, BLEND), BLEND)
    assert min_prefix(Mode.FULL_PREFILL, 100, 16) == 1
    assert min_prefix(Mode.BLEND, 100, 16) == 96  # every passage, up to the block they end in


@pytest.mark.parametrize("bad", [(0, 4), (4, 0)])
def test_pool_validates(bad):
    with pytest.raises(ValueError):
        BlockPool(*bad)


def test_a_new_run_is_placed_with_room_to_grow_in_place_and_the_room_shrinks_when_the_pool_is_tight():
    pool = BlockPool(12, 4, room=2)
    a = pool.allocate(2)
    b = pool.allocate(2)  # not in a's room (blocks 2-3), and with room of its own after it
    assert (a, b) == (Run(0, 2), Run(4, 2)) and pool.in_use == 4  # the room is not taken
    for n in (3, 4):
        a, moved, _ = pool.grow(a)
        assert (a, moved) == (Run(0, n), False)  # in place, twice: no copy
    c = pool.allocate(2)  # blocks 6-7 are b's room and 8-11 hold no window padded on both sides
    assert c == Run(8, 2)  # room after it, none before: it sits right after b's room
    d = pool.allocate(2)  # no room left anywhere: packed tight
    assert d == Run(6, 2)
    assert pool.allocate(1) == Run(10, 1) and pool.allocate(1) == Run(11, 1) and pool.allocate(1) is None


@pytest.mark.parametrize("seed", range(20))
def test_the_sliding_window_search_equals_its_definition(seed):
    """`_best_window` against the rule written out: every start whose padded window has no block
    in use, the fewest cached blocks in the run, then the least recently used."""
    import random

    rng = random.Random(seed)
    pool = BlockPool(rng.randint(4, 30), 4)
    for b in range(pool.n_blocks):
        state = rng.random()
        if state < 0.3:
            pool._ref[b] = 1
        elif state < 0.6:
            pool._hash[b], pool._used_at[b] = f"h{b}", rng.randint(1, 50)
    for _ in range(10):
        n, before, after = rng.randint(1, 6), rng.randint(0, 3), rng.randint(0, 3)
        ok = [s for s in range(pool.n_blocks - n - after + 1)
              if all(pool._ref[b] == 0 for b in range(max(0, s - before), s + n + after))]

        def cost(s, n=n):
            named = [b for b in range(s, s + n) if pool._hash[b] is not None]
            return len(named), sum(pool._used_at[b] for b in named), s

        want = min(ok, key=cost) if ok else None
        got = pool._best_window(n, before, after)
        assert got == want, (n, before, after)


def test_decoding_sequences_grow_in_place_while_the_pool_has_room():
    """Eight sequences admitted together and decoding 100 tokens each (blocks of 4: 25 new
    blocks each) in a pool with space: every growth is in place, none copies its KV."""
    s = BatchScheduler(BatchLimits(max_batch=8, prefill_step_tokens=100, block_tokens=4), 600, 1)
    for rid in range(8):
        s.add(SeqSpec(rid, 30))
    s.schedule()
    for rid in range(8):
        s.prefilled(rid)
    moved = 0
    for _ in range(100):
        moved += sum(m.moved for m in s.schedule().moves)
        s.applied()
    assert moved == 0 and s.running == 8


@pytest.mark.parametrize("seed", range(10))
def test_the_cached_and_in_use_counts_follow_every_operation(seed):
    """`cached` and `in_use` are counters (read by /metrics on every scrape, so O(1)): after any mix of
    allocations, registrations, growth, pins and releases they equal the block states counted out."""
    import random

    rng = random.Random(seed)
    pool = BlockPool(rng.randint(8, 40), 4, room=rng.randint(0, 2))
    runs: list[Run] = []
    pinned: list[list[int]] = []
    for step in range(200):
        op = rng.random()
        if op < 0.3:
            run = pool.allocate(rng.randint(1, 5))
            if run is not None:
                runs.append(run)
        elif op < 0.45 and runs:
            run = rng.choice(runs)
            pool.register(run, [f"s{seed}-{step}-{i}" for i in range(rng.randint(1, run.n))])
        elif op < 0.6 and runs:
            i = rng.randrange(len(runs))
            grown = pool.grow(runs[i], rng.randint(1, 2))
            if grown is not None:
                new, moved, given_back = grown
                if moved and not given_back:
                    pool.release(runs[i])
                runs[i] = new
        elif op < 0.7:
            named = [b for b in range(pool.n_blocks) if pool._hash[b] is not None]
            if named:
                blocks = rng.sample(named, min(len(named), 2))
                pool.pin(blocks)
                pinned.append(blocks)
        elif op < 0.8 and pinned:
            pool.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif runs:
            pool.release(runs.pop(rng.randrange(len(runs))))
        assert pool.cached == sum(1 for b in range(pool.n_blocks) if pool._prefix(b) and pool._ref[b] == 0)
        assert {(h, b) for h, bs in pool._by_hash.items() for b in bs} == {
            (pool._hash[b], b) for b in range(pool.n_blocks) if pool._prefix(b)}  # the index names each prompt block once
        assert pool.in_use == sum(1 for b in range(pool.n_blocks) if pool._ref[b] > 0)
