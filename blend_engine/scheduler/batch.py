"""Continuous batching over the paged KV pool: what each engine step runs. Torch-free: request
ids, block runs and token counts (`kv_blocks`); the executor turns a `StepPlan` into tensor work.

Each step of the engine loop:

    grow     every decoding sequence whose next token needs a new block gets it (in place, or its
             run moves to a larger window); when the pool has no room, the youngest running
             request is preempted (its blocks freed, its prompt blocks cached), re-queued first,
             and later recomputed: it finishes with the tokens it would have had
    admit    waiting requests in order while the batch has room (`max_batch`) and a run of blocks
             for their prompt is free; each first takes the longest cached prefix of its prompt
             (automatic prefix caching), in place or copied, and computes only the rest
    prefill  while others decode, a step's prefill work is bounded by `prefill_step_tokens`
             (tokens x layers; `PrefillBudget`), and by what `prefill_step_s` buys at the cost
             the engine measured on its own steps (`step_time.StepTime`): the prefix copies of
             this step's admissions are paid first (admission stops once they spent it), then
             partly prefilled requests advance, oldest first, each layer they enter costing its
             rows plus a fixed `prefill_layer_overhead`; with nothing decoding the oldest runs whole
    decode   every request past its prefill decodes one token

The executor runs a step as ONE pass over the layers: at each layer the decode rows and the rows
of every prefill at that layer go through one projection and one MLP call (`layers.layer_pass`).

Blocks are taken as tokens arrive (a prompt's run at admission, one block per `block_tokens`
decoded tokens), never reserved for `max_tokens`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from blend_engine.scheduler.admission import batch_has_room
from blend_engine.scheduler.kv_blocks import NO_PREFIX, BlockPool, Run, blocks_for
from blend_engine.scheduler.step_time import StepTime

GROWTH_ROOM_TOKENS = 128  # decoded tokens a new run is placed to grow by in place, where the pool has room


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 8  # requests prefilling or decoding at once
    kv_budget_bytes: int = 2 << 30  # the KV pool: every running request's blocks and the cached prefixes
    prefill_step_tokens: int = 4096  # prefill work per step while others decode (tokens x layers)
    block_tokens: int = 16  # token slots per KV block
    max_queue: int | None = None  # requests waiting for the batch before `Overloaded`; None: no bound
    # What a step's prefill work costs beside its rows, in the same unit (fitted to fused steps' times on
    # 2 CPU cores, SmolLM2-135M: a prefill's own attention call, rotation and KV write per layer it enters
    # ~ 12 rows; a cached prefix token's K/V copied at admission, over every layer ~ 0.35 rows x layers)
    prefill_layer_overhead: int = 12
    prefix_copy_cost: float = 0.35
    # while others decode, the prefill work a step carries is also cut to what this many seconds buy at
    # the measured cost of a unit (`step_time.StepTime`); None: `prefill_step_tokens` alone
    prefill_step_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.kv_budget_bytes < 1:
            raise ValueError("kv_budget_bytes must be >= 1")
        if self.prefill_step_tokens < 1:
            raise ValueError("prefill_step_tokens must be >= 1")
        if self.prefill_layer_overhead < 0 or self.prefix_copy_cost < 0:
            raise ValueError("prefill_layer_overhead and prefix_copy_cost must be >= 0")
        if self.prefill_step_s is not None and self.prefill_step_s <= 0:
            raise ValueError("prefill_step_s must be > 0 (or None)")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")


@dataclass(frozen=True)
class SeqSpec:
    """A request as the scheduler sees it.

    `lookups`: hash chains of the prompt's full blocks under each root whose KV it may take (the
    longest cached prefix wins); `own`: the chain its blocks are registered under when it took no
    prefix; `min_hit`: a shorter prefix is not taken (blend must find every passage in it)."""

    rid: int
    n_prompt: int
    lookups: tuple[tuple[str, ...], ...] = ()
    own: tuple[str, ...] = ()
    min_hit: int = 1


@dataclass(frozen=True)
class Admission:
    """A request that starts its prefill: its run, the prefix already in it (`prefix_tokens`,
    block-aligned) and the blocks to copy there first (`copy_from`: the cached prefix's blocks,
    copied to the run's first blocks; empty when the run adopted them in place)."""

    rid: int
    run: Run
    prefix_tokens: int = 0
    copy_from: tuple[int, ...] = ()


@dataclass(frozen=True)
class Move:
    """A run that grew: `moved` when its KV must be copied from `old` to `new` (else the same
    blocks plus more, and only its views change)."""

    rid: int
    old: Run
    new: Run
    moved: bool


@dataclass(frozen=True)
class StepPlan:
    """One engine step, in the order the executor applies it."""

    preempt: tuple[int, ...] = ()
    moves: tuple[Move, ...] = ()
    admit: tuple[Admission, ...] = ()
    prefill: tuple[int, ...] = ()
    prefill_tokens: int | None = None  # the prefills' shared budget (None: the first runs whole)
    decode: tuple[int, ...] = ()
    held: tuple[int, str] | None = None  # the head of the queue, not admitted: (rid, why: `admission.DECISIONS`)
    copied: int = 0  # the prefill work this step's admissions spent on prefix copies (`BatchLimits.prefix_copy_cost`)

    @property
    def idle(self) -> bool:
        return not (self.admit or self.prefill or self.decode or self.preempt)


class PrefillBudget:
    """A step's prefill work, in tokens x layers (None: unbounded), given oldest first: in age
    order each prefill is allotted what is left, up to the most it could use this step (`allot`);
    it then runs layer after layer while its allotment lasts (the layer that crosses it included).
    A prefill allotted nothing waits for the next step. So the oldest prefill advances as if alone
    and the younger ones use what it leaves, while all of them share each layer's pass. A layer
    costs its rows plus `layer_overhead` (what a prefill's layer costs beside its rows: with many
    short prefills, e.g. exact repeats that compute their last few tokens, that is most of it)."""

    def __init__(self, tokens: int | None, layer_overhead: int = 0) -> None:
        self.left = tokens
        self.layer_overhead = layer_overhead
        self.spent = 0  # the work the prefills took (`step_time.StepTime` learns its cost)
        self._own: dict[int, int | None] = {}

    def allot(self, rid: int, rows: int, layers: int) -> None:
        """Before the step, oldest first: `rid` could compute at most `layers` more layers of at
        most `rows` rows this step (rows only shrink along a prefill)."""
        if self.left is None:
            self._own[rid] = None
            return
        give = max(0, min(self.left, (rows + self.layer_overhead) * layers))
        self._own[rid] = give
        self.left -= give

    def take(self, rid: int, rows: int) -> bool:
        """May `rid` compute its next layer (`rows` tokens) in this step? If so, they are spent."""
        own = self._own.get(rid, 0)
        if own is not None and own <= 0:
            return False
        self.spent += rows + self.layer_overhead
        if own is not None:
            self._own[rid] = own - rows - self.layer_overhead
        return True


@dataclass
class _Seq:
    spec: SeqSpec
    run: Run
    order: int  # admission order: the youngest is preempted first
    length: int = 0  # tokens in its KV (the next decode writes at this position)
    decoding: bool = False
    chain: tuple[str, ...] = ()  # registered after the prefill
    held: list[Run] = field(default_factory=list)  # runs kept until the step's copies are applied


class BatchScheduler:
    """Waiting queue, running sequences and the block pool. The engine loop alone changes it; the
    introspection properties read plain ints (safe from a metrics scrape)."""

    def __init__(self, limits: BatchLimits, n_blocks: int, block_bytes: int = 0) -> None:
        self.limits = limits
        self.block_bytes = block_bytes  # one block's K/V over every layer (for the byte gauges)
        self.pool = BlockPool(n_blocks, limits.block_tokens, room=blocks_for(GROWTH_ROOM_TOKENS, limits.block_tokens))
        self._waiting: deque[SeqSpec] = deque()
        self._running: dict[int, _Seq] = {}
        self._pinned: list[list[int]] = []  # copy sources held until `applied`
        self._order = 0
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.step_time = StepTime(limits.prefill_step_s)  # told each step's time by the engine loop

    # ------------------------------------------------------------------ state changes
    def add(self, spec: SeqSpec) -> None:
        self._waiting.append(spec)

    def prefilled(self, rid: int) -> None:
        """`rid` finished its prefill: its prompt blocks are registered; it decodes from the next step."""
        seq = self._running.get(rid)
        if seq is None or seq.decoding:
            raise ValueError(f"request {rid} is not prefilling")
        seq.decoding = True
        seq.length = seq.spec.n_prompt
        self.pool.register(seq.run, seq.chain)

    def finish(self, rid: int) -> None:
        """`rid` is done (last token, cancelled, failed), wherever it was: its blocks go back."""
        self._waiting = deque(s for s in self._waiting if s.rid != rid)
        seq = self._running.pop(rid, None)
        if seq is not None:
            self._release(seq)

    def applied(self) -> None:
        """The executor copied this step's prefixes and moved runs: their sources go back."""
        for blocks in self._pinned:
            self.pool.unpin(blocks)
        self._pinned.clear()
        for seq in self._running.values():
            for run in seq.held:
                self.pool.release(run)
            seq.held.clear()

    # ------------------------------------------------------------------ the step
    def schedule(self) -> StepPlan:
        preempt: list[int] = []
        moves = self._grow(preempt)
        decode = tuple(rid for rid, s in self._running.items() if s.decoding)
        for rid in decode:
            self._running[rid].length += 1  # this step's token
        budget = self.step_time.units(self.limits.prefill_step_tokens) if decode else None
        admit, held, left = self._admit(budget)
        prefilling = tuple(rid for rid, s in self._running.items() if not s.decoding)
        if left is not None and left <= 0:  # this step's prefix copies spent its prefill work
            prefilling = ()
        copied = 0 if budget is None or left is None else budget - left
        return StepPlan(tuple(preempt), tuple(moves), tuple(admit),
                        prefilling if decode else prefilling[:1], left, decode, held, copied)

    def _grow(self, preempt: list[int]) -> list[Move]:
        """A block for every decoding sequence whose next token needs one; preempting the youngest
        when the pool has no room."""
        moves = []
        for rid in sorted((r for r, s in self._running.items() if s.decoding), key=lambda r: self._running[r].order):
            seq = self._running.get(rid)
            while seq is not None and blocks_for(seq.length + 1, self.limits.block_tokens) > seq.run.n:
                grown = self.pool.grow(seq.run)
                if grown is not None:
                    new, moved, given_back = grown
                    if moved and not given_back:
                        seq.held.append(seq.run)
                    moves.append(Move(rid, seq.run, new, moved))
                    seq.run = new
                    break
                victim = self._youngest()
                preempt.append(victim)
                self._preempt(victim)
                seq = self._running.get(rid)
        return [m for m in moves if m.rid in self._running]

    def _youngest(self) -> int:
        return max(self._running, key=lambda r: self._running[r].order)

    def _preempt(self, rid: int) -> None:
        """Free the sequence's blocks (its registered prompt blocks stay cached) and queue it first:
        it is recomputed from its prompt when admitted again."""
        seq = self._running.pop(rid)
        self._release(seq)
        self._waiting.appendleft(SeqSpec(rid, seq.spec.n_prompt, own=seq.spec.own, min_hit=NO_PREFIX))
        self.preemptions += 1

    def _release(self, seq: _Seq) -> None:
        """Give back a sequence's run and any run it still holds from a move this step."""
        self.pool.release(seq.run)
        for run in seq.held:
            self.pool.release(run)

    def _admit(self, budget: int | None) -> tuple[list[Admission], tuple[int, str] | None, int | None]:
        """Waiting requests in order while the batch has room, their blocks are free and the step's
        prefill `budget` (None: unbounded) is not spent on their prefix copies; the head left
        waiting and why (`admission.DECISIONS`), and the budget left."""
        out: list[Admission] = []
        while self._waiting:
            head = self._waiting[0].rid
            if not batch_has_room(len(self._running), self.limits.max_batch):
                return out, (head, "waited_batch_full"), budget
            if budget is not None and budget <= 0:
                return out, (head, "waited_step_budget"), budget
            adm = self._place(self._waiting[0])
            if adm is None:  # its blocks are not free yet: requests behind it wait too (no overtaking)
                return out, (head, "waited_kv_blocks"), budget
            self._waiting.popleft()
            out.append(adm)
            budget = None if budget is None else budget - self._copy_cost(adm)
        return out, None, budget

    def _copy_cost(self, adm: Admission) -> int:
        """The prefill work (tokens x layers) that copying `adm`'s cached prefix into its run costs."""
        return round(len(adm.copy_from) * self.limits.block_tokens * self.limits.prefix_copy_cost)

    def _place(self, spec: SeqSpec) -> Admission | None:
        """The head request's run: the longest usable cached prefix, in place or to be copied."""
        bt = self.limits.block_tokens
        need = blocks_for(spec.n_prompt + 1, bt)
        chain, hit = self._best_prefix(spec)
        adm = None
        if hit and all(b == hit[0] + i for i, b in enumerate(hit)):
            run = self.pool.allocate_at(hit[0], need, keep=len(hit))
            adm = None if run is None else Admission(spec.rid, run, len(hit) * bt)
        if adm is None and hit:
            self.pool.pin(hit)
            run = self.pool.allocate(need)
            if run is None:
                self.pool.unpin(hit)
                return None
            self._pinned.append(hit)
            adm = Admission(spec.rid, run, len(hit) * bt, tuple(hit))
        if adm is None:
            run = self.pool.allocate(need)
            if run is None:
                return None
            adm, chain = Admission(spec.rid, run), spec.own
        self._order += 1
        self._running[spec.rid] = _Seq(spec, adm.run, self._order, chain=chain)
        self.prefix_hit_tokens += adm.prefix_tokens
        return adm

    def _best_prefix(self, spec: SeqSpec) -> tuple[tuple[str, ...], list[int]]:
        """(its chain, its blocks) of the longest cached prefix the request may take, at most up to
        the block before its last token (the last token is always computed: its logits)."""
        bt = self.limits.block_tokens
        limit = (spec.n_prompt - 1) // bt
        best: tuple[tuple[str, ...], list[int]] = (spec.own, [])
        for chain in spec.lookups:
            blocks = self.pool.lookup(chain[:limit])
            if len(blocks) > len(best[1]) and len(blocks) * bt >= spec.min_hit:
                best = (chain, blocks)
        return best

    # ------------------------------------------------------------------ introspection
    def cached_prefix_tokens(self, spec: SeqSpec) -> int:
        """The tokens of the cached prefix the request would take if admitted now (`_best_prefix`
        without touching the blocks' last use)."""
        bt = self.limits.block_tokens
        limit = (spec.n_prompt - 1) // bt
        held = [self.pool.peek(chain[:limit]) * bt for chain in spec.lookups]
        return max((t for t in held if t >= spec.min_hit), default=0)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the pool's blocks in use (running requests; cached prefixes are free to take)."""
        return self.pool.in_use * self.block_bytes
