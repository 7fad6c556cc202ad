"""Continuous batching on the real model (SmolLM2-135M, fp32 on the CPU): a request's greedy tokens
are the same alone and in a batch of 8 with prompts of other lengths; cancelling one member changes
no other member's tokens; the scheduler admits by batch size and KV budget and bounds prefill steps."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from blend_engine.cancel import Cancelled
from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.kv_store import MemoryStore
from blend_engine.scheduler.batch import BatchLimits, BatchScheduler, SeqSpec
from blend_engine.types import BlendPlan, GenerationConfig
from tests.helpers import run_threads

SAMPLE = Path(__file__).resolve().parents[2] / "sample_corpus" / "hotpotqa_sample.jsonl"
SYSTEM = "You are a helpful assistant. Answer in two or three full sentences, using the passages."
GEN = GenerationConfig(max_tokens=16)


def _plans(n: int) -> list[BlendPlan]:
    """n prompts of other lengths: 1 to 4 sample-corpus passages each, a question on the first."""
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:3 * n + 4]]
    plans = []
    for i in range(n):
        k = 1 + i % 4
        docs = rows[3 * i:3 * i + k]
        plans.append(BlendPlan(tuple(f"{d['title']}\n{d['text'][:600]}" for d in docs),
                               f"What is {docs[0]['title']} known for?", recompute_ratio=0.15, system_prompt=SYSTEM))
    return plans


@pytest.fixture(scope="module")
def engine(real_runner):
    eng = BlendEngine(real_runner, MemoryStore(1 << 30), EngineConfig(batch=BatchLimits(max_batch=8)))
    yield eng
    eng.close()


PLANS = _plans(20)


@pytest.fixture(scope="module")
def alone(engine) -> list[tuple[int, ...]]:
    """Each plan's tokens alone, its chunks cached first (so that every run, alone or batched,
    blends the same cached chunks)."""
    for p in PLANS:
        for seg in engine.layout(p).segments[:-1]:
            engine.cache_ids(seg.token_ids)
    return [engine.run(p, GEN).token_ids for p in PLANS]


def _together(engine: BlendEngine, plans: list[BlendPlan], cancel: int | None = None) -> list:
    """Run the plans concurrently (they share the engine loop's batch); per plan its result, or the
    exception it ended with. With `cancel`, that one is cancelled after its first delta."""
    out: list = [None] * len(plans)
    start = threading.Barrier(len(plans))

    def one(i: int) -> None:
        g = engine.generate(plans[i], GEN)
        start.wait()
        try:
            for _ in g:
                if i == cancel:
                    g.cancel()
            out[i] = g.result
        except Cancelled as exc:
            out[i] = exc

    run_threads(one, len(plans))
    return out


def test_greedy_tokens_are_the_same_alone_and_in_a_batch_of_8(engine, alone):
    plans = PLANS
    assert sum(len(t) == GEN.max_tokens for t in alone) >= 15  # long answers: the batch really overlaps
    lengths = {engine.layout(p).n_tokens for p in plans}
    assert len(lengths) >= 10  # prompts of other lengths
    seen = engine.loop.max_batch_seen
    batched = []
    for start in range(0, 20, 8):  # batches of 8, 8 and 4
        batched += [r.token_ids for r in _together(engine, plans[start:start + 8])]
    assert engine.loop.max_batch_seen == 8 > seen
    assert batched == alone


def test_cancelling_one_member_changes_no_other_members_tokens(engine, alone):
    plans = PLANS[:8]
    got = _together(engine, plans, cancel=3)
    assert isinstance(got[3], Cancelled)
    assert [r.token_ids for i, r in enumerate(got) if i != 3] == [t for i, t in enumerate(alone[:8]) if i != 3]
    assert engine.loop.scheduler.running == 0 and engine.loop.scheduler.kv_bytes == 0  # nothing left behind


def test_a_failing_member_leaves_the_batch_alone(engine, alone, monkeypatch):
    """A request whose prefill fails on the loop (here: as it starts) gets its error; the others
    finish with their own tokens."""
    plans = PLANS[:3]
    start_run = engine.start_run

    def failing(plan, prep, max_new_tokens, **kw):
        if plan is plans[1]:
            raise OSError("simulated read failure")
        return start_run(plan, prep, max_new_tokens, **kw)

    monkeypatch.setattr(engine, "start_run", failing)
    out: list = [None] * 3

    def one(i: int) -> None:
        try:
            out[i] = engine.run(plans[i], GEN).token_ids
        except OSError as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert isinstance(out[1], OSError) and [out[0], out[2]] == [alone[0], alone[2]]


# ---------------------------------------------------------------------------- the scheduler alone
def test_admission_by_batch_size_and_free_blocks():
    """Blocks per prompt (+1 for the first decoded token), not per max_tokens; no overtaking."""
    s = BatchScheduler(BatchLimits(max_batch=2, prefill_step_tokens=10, block_tokens=4), n_blocks=10, block_bytes=1)
    for rid, n in [(0, 11), (1, 7), (2, 3), (3, 30)]:
        s.add(SeqSpec(rid, n))
    step = s.schedule()
    assert [a.rid for a in step.admit] == [0, 1] and step.prefill == (0,) and step.prefill_tokens is None
    assert s.kv_bytes == 3 + 2  # ceil(12/4) + ceil(8/4) blocks
    s.prefilled(0)
    step = s.schedule()
    assert step.admit == () and step.decode == (0,) and step.prefill == (1,) and step.prefill_tokens == 10
    s.prefilled(1)
    s.finish(0)
    step = s.schedule()
    assert [a.rid for a in step.admit] == [2]  # the batch is full again: 3 waits
    s.prefilled(2)
    s.schedule()
    assert s.waiting == 1  # 3 needs 8 blocks; 1 and 2 hold 3 of the 10
    s.finish(1)
    s.finish(2)
    assert [a.rid for a in s.schedule().admit] == [3]
    s.finish(3)
    assert not s.has_work and s.kv_bytes == 0


def test_limits_are_validated():
    for bad in ({"max_batch": 0}, {"kv_budget_bytes": 0}, {"prefill_step_tokens": 0}, {"block_tokens": 0}):
        with pytest.raises(ValueError):
            BatchLimits(**bad)


def test_the_loop_prefills_without_an_autograd_graph(engine, real_runner):
    """A loaded model's weights require grad: a prefill run by the loop (not only `BlendEngine.prefill`)
    must record no graph, which would keep every layer's activations alive until the request ends."""
    assert any(p.requires_grad for p in real_runner.model.parameters())
    g = engine.generate(_plans(1)[0], GenerationConfig(max_tokens=2))
    list(g)
    assert not g.state.logits.requires_grad and g.state.logits.grad_fn is None
    assert torch.is_inference(g.state.cache.k[0])
