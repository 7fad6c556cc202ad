"""The paged KV pool's bookkeeping: blocks, runs, reference counts and the prefix cache index.
Torch-free: block ids and hashes only; the tensors live in `executor.kv_pool.KVPool`.

The pool is `n_blocks` blocks of `block_tokens` token slots (every layer's K and V). A running
sequence holds a **run**: consecutive blocks, so that its KV is one strided view of the pool and
the CPU's attention reads it with no gather (measured: gathering scattered blocks made a batch-16
decode step 7x slower). Blocks are taken as tokens arrive: a run grows in place by one block when
its next block is not in use, else moves to a larger window (`BlockPool.grow`): a copy of the
sequence's whole KV. New windows are placed, where the pool has space, with free room after them
(`BlockPool.allocate`, `batch.GROWTH_ROOM_TOKENS`), so that moves stay rare.

Automatic prefix caching (vLLM's, over runs): after a prefill the full blocks of the prompt are
registered under a hash chain of their tokens,

    | block 0        | block 1        | ...
      h0 = H(root, tokens 0..B-1)   h1 = H(h0, tokens B..2B-1)   ...   root = model + salt + recipe

and when the sequence ends they stay **cached** (reference count 0, evictable, least recently used
first). A later prompt that starts with the same tokens takes the longest chain of cached blocks:
in place when they are consecutive and the window they start is free (no copy), else copied into
its own run. The recipe in the root keeps exact KV (full prefill) apart from blended or reused KV
with the same tokens.

Two rules keep an exact repeat in place (measured: 9 of 12 repeats copied their ~770-token prefix
without them, ~7 ms each on 2 cores, inside the step others decode in):

- a hash may name several blocks: every run registers its own prompt blocks, so prompts that
  share a first block (the system prompt) each keep a consecutive chain (`lookup` prefers one);
- the block after a run's prompt blocks (where a repeat computes its last tokens) is kept as the
  chain's **tail**: cached, unnamed, evicted like a cached block, so a new run starts there only
  when no free window is left:

    | prompt A's blocks | tail A | prompt B's blocks | tail B | decode room ...
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from blend_engine.types import Mode

EXACT, BLEND, REUSE = "exact", "blend", "reuse"  # how a chain's KV was computed (its root)
TAIL = "tail"  # the name of the block after a registered chain (`BlockPool.register`); never looked up
NO_PREFIX = 1 << 62  # a `min_prefix` no cached prefix reaches: the request computes its whole prompt


def blocks_for(n_tokens: int, block_tokens: int) -> int:
    """Blocks that hold `n_tokens` token slots."""
    return -(-n_tokens // block_tokens)


def chain_root(fingerprint: str, salt: str | None, recipe: str) -> str:
    """The root of a prompt's hash chain: the model, the tenant's namespace, how the KV was made."""
    return hashlib.blake2b(f"{fingerprint}|{salt or ''}|{recipe}".encode(), digest_size=16).hexdigest()


def chain_hashes(root: str, token_ids: Sequence[int], block_tokens: int) -> tuple[str, ...]:
    """One hash per full block of `token_ids`, each over its parent's hash and its tokens."""
    out, parent = [], root
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(parent.encode(), digest_size=16)
        h.update(b",".join(str(t).encode() for t in token_ids[start:start + block_tokens]))
        parent = h.hexdigest()
        out.append(parent)
    return tuple(out)


@dataclass(frozen=True)
class Run:
    """Consecutive blocks [start, start + n) held by one sequence."""

    start: int
    n: int

    @property
    def blocks(self) -> range:
        return range(self.start, self.start + self.n)


class BlockPool:
    """Block states: in use (reference count > 0), cached (count 0, registered under a hash) or free.
    Changed by the engine loop's thread only; the counters are plain ints (read by metrics)."""

    def __init__(self, n_blocks: int, block_tokens: int, room: int = 0) -> None:
        if n_blocks < 1 or block_tokens < 1:
            raise ValueError("a KV pool needs at least one block of at least one token")
        if room < 0:
            raise ValueError("a run's growth room cannot be negative")
        self.n_blocks, self.block_tokens = n_blocks, block_tokens
        self.room = room  # free blocks a new window is placed to keep after it (`allocate`); none are taken
        self._ref = [0] * n_blocks
        self._hash: list[str | None] = [None] * n_blocks  # a block's chain hash, `TAIL`, or None (free)
        self._by_hash: dict[str, list[int]] = {}  # the blocks each hash names, oldest first
        self._used_at = [0] * n_blocks  # when a cached block was last released or hit (LRU)
        self._clock = 0
        self.in_use = 0  # blocks with a reference
        self.cached = 0  # blocks that hold a registered prefix and nobody uses (evictable; tails not counted)
        self.evictions = 0

    # ------------------------------------------------------------------ introspection
    @property
    def free(self) -> int:
        """Blocks not in use (free or cached)."""
        return self.n_blocks - self.in_use

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, hashes: Sequence[str]) -> list[int]:
        """The blocks of the longest registered prefix of `hashes`, consecutive ones where the pool
        holds such a chain (touched: most recently used)."""
        n = self.peek(hashes)
        found = self._consecutive(hashes[:n]) or [self._by_hash[h][0] for h in hashes[:n]]
        self._clock += 1
        for b in found:
            self._used_at[b] = self._clock
        return found

    def peek(self, hashes: Sequence[str]) -> int:
        """How many leading `hashes` are registered (`lookup` without touching their last use)."""
        n = 0
        for h in hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def register(self, run: Run, hashes: Sequence[str]) -> None:
        """Name the run's first blocks by `hashes` (their content is final: prompt blocks; a hash
        may name other blocks too), and keep the block after them as the chain's tail."""
        for b, h in zip(run.blocks, hashes):
            if self._hash[b] is None:
                self._name(b, h)
        tail = run.start + len(hashes)
        if len(hashes) < run.n and self._hash[tail] is None:
            self._name(tail, TAIL)

    def _name(self, b: int, h: str) -> None:
        self._hash[b] = h
        if h != TAIL:
            self._by_hash.setdefault(h, []).append(b)
        self.cached += self._ref[b] == 0 and self._prefix(b)

    def _consecutive(self, hashes: Sequence[str]) -> list[int] | None:
        """Consecutive blocks named by `hashes` in order, if the pool holds such a chain."""
        if not hashes:
            return None
        for last in self._by_hash[hashes[-1]]:
            start = last - len(hashes) + 1
            if start >= 0 and all(self._hash[start + i] == h for i, h in enumerate(hashes)):
                return list(range(start, last + 1))
        return None

    # ------------------------------------------------------------------ runs
    def allocate(self, n: int) -> Run | None:
        """A run of `n` consecutive blocks none of which is in use, evicting cached blocks (the
        window with the fewest, least recently used first). None: no such window.

        Where the pool has space, the window keeps `room` blocks not in use after it, and does not
        start within `room` blocks after another run (that run's room), so that decoding grows
        runs in place instead of moving them; only the `n` blocks are taken, and when no such
        window is left the room shrinks to after it alone, then to none:

            | run a | room of a | new run | room of new | ... | run b |
        """
        paddings = ((self.room, self.room), (0, self.room), (0, 0)) if self.room else ((0, 0),)
        for before, after in paddings:
            start = self._best_window(n, before, after)
            if start is not None:
                return self._take(Run(start, n))
        return None

    def allocate_at(self, start: int, n: int, keep: int) -> Run | None:
        """The run [start, start + n) when none of it is in use: a cached prefix of `keep` blocks
        at `start` adopted in place (they keep their registration). None: the window is taken."""
        return self._take(Run(start, n), keep) if self._window_free(start, n) else None

    def grow(self, run: Run, n_more: int = 1) -> tuple[Run, bool, bool] | None:
        """(the longer run, whether it moved, whether the old run is already given back): in place
        when the blocks after it are not in use; else a new window (the caller copies the KV, then
        `release`s the old run); else a window that overlaps its own blocks (compaction: the caller
        copies at once, before anything is written to the pool). None: no room."""
        if self._window_free(run.start + run.n, n_more):
            self._take(Run(run.start + run.n, n_more))
            return Run(run.start, run.n + n_more), False, False
        new = self.allocate(run.n + n_more)
        if new is not None:
            return new, True, False
        for b in run.blocks:
            self._unref(b)
        new = self.allocate(run.n + n_more)
        if new is None:
            self._take(run, keep=run.n)
            return None
        return new, True, True

    def release(self, run: Run) -> None:
        """The run's sequence is done with it: registered blocks stay cached, the rest are free."""
        self._clock += 1
        for b in run.blocks:
            self._unref(b)

    def pin(self, blocks: Sequence[int]) -> None:
        """Hold blocks (a prefix about to be copied) so that no allocation evicts them."""
        for b in blocks:
            if self._ref[b] == 0:
                self.in_use += 1
                self.cached -= self._prefix(b)
            self._ref[b] += 1

    def unpin(self, blocks: Sequence[int]) -> None:
        self._clock += 1
        for b in blocks:
            self._unref(b)

    # ------------------------------------------------------------------ internals
    def _unref(self, b: int) -> None:
        if self._ref[b] <= 0:
            raise AssertionError(f"block {b} released twice")
        self._ref[b] -= 1
        if self._ref[b] == 0:
            self.in_use -= 1
            self.cached += self._prefix(b)
            self._used_at[b] = self._clock

    def _window_free(self, start: int, n: int) -> bool:
        return start >= 0 and start + n <= self.n_blocks and all(self._ref[b] == 0 for b in range(start, start + n))

    def _take(self, run: Run, keep: int = 0) -> Run:
        """Reference the run's blocks; past the first `keep` they are about to be overwritten, so
        their registrations are evicted."""
        for i, b in enumerate(run.blocks):
            self.cached -= self._ref[b] == 0 and self._prefix(b)
            self.in_use += self._ref[b] == 0
            self._ref[b] += 1
            if i >= keep:
                self._evict(b)
        return run

    def _evict(self, b: int) -> None:
        h = self._hash[b]
        if h is None:
            return
        self._hash[b] = None
        if h == TAIL:
            return
        named = self._by_hash[h]
        named.remove(b)
        if not named:
            del self._by_hash[h]
        self.evictions += 1

    def _best_window(self, n: int, before: int = 0, after: int = 0) -> int | None:
        """The start of n blocks, none in use and none in use `before` blocks ahead of them or
        `after` blocks past them (blocks before the pool's start count as free, past its end as
        taken), that evicts the fewest cached blocks, then the least recently used ones. Sliding
        sums: in-use blocks over the padded window, cached ones and their last uses over the run."""
        if n + after > self.n_blocks:
            return None
        best, best_cost = None, None
        held = sum(self._held(b) for b in range(min(n + after, self.n_blocks)))
        count = sum(self._named(b) for b in range(n))
        ticks = sum(self._used_at[b] * self._named(b) for b in range(n))
        for start in range(self.n_blocks - n - after + 1):
            if start:  # slide by one: the blocks entering at the right, leaving at the left
                held += self._held(start + n + after - 1) - (self._held(start - before - 1) if start > before else 0)
                count += self._named(start + n - 1) - self._named(start - 1)
                ticks += (self._used_at[start + n - 1] * self._named(start + n - 1)
                          - self._used_at[start - 1] * self._named(start - 1))
            if held == 0 and (best_cost is None or (count, ticks) < best_cost):
                best, best_cost = start, (count, ticks)
                if count == 0:
                    break  # a window of free blocks: nothing better
        return best

    def _held(self, b: int) -> int:
        return int(self._ref[b] > 0)

    def _prefix(self, b: int) -> bool:
        """`b` holds a registered prompt block (not a tail)."""
        h = self._hash[b]
        return h is not None and h != TAIL

    def _named(self, b: int) -> int:
        """1 for a cached block (registered or a tail, not in use): one an allocation over it evicts."""
        return int(self._hash[b] is not None and self._ref[b] == 0)


def recipes(mode: Mode) -> tuple[tuple[str, ...], str]:
    """(the chain roots whose KV a prefill in `mode` may take, the root its own KV is registered
    under). Exact KV serves every mode; blended KV serves blend and full reuse; reused KV only
    full reuse."""
    if mode is Mode.BLEND:
        return (EXACT, BLEND), BLEND
    if mode is Mode.FULL_REUSE:
        return (EXACT, BLEND, REUSE), REUSE
    return (EXACT,), EXACT


def min_prefix(mode: Mode, context_end: int, block_tokens: int) -> int:
    """The shortest cached prefix worth taking. Blend and full reuse compute the rest exactly over
    it, so the prefix must hold every passage (up to the block the passages end in); the exact
    modes take any block."""
    if mode in (Mode.BLEND, Mode.FULL_REUSE):
        return max(block_tokens, context_end // block_tokens * block_tokens)
    return 1
