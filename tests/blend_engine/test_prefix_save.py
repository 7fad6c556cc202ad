"""prefix_cache mode saves after the first token, off the critical path (#27 item 6).

The save of a request's in-context KV is held back by a gate in the copy's completion
(`HostCopy.kv`, where the saver thread waits for the device on CUDA), so "the answer did not wait
for the save" is an order of recorded events, never a time: the first token, then the save issued,
then the whole answer, all while the copy has not completed. The next request opens the gate when
it asks for the pending entry, and must reuse it.
"""

from __future__ import annotations

import threading

import pytest
import torch

from blend_engine.engine import BlendEngine, EngineConfig
from blend_engine.executor.layers import KVCache
from blend_engine.executor.offload import HostCopy, copy_to_host, save_stream
from blend_engine.generation import Generation
from blend_engine.kv_store import MemoryStore
from blend_engine.prefix_cache import PrefixCache
from blend_engine.types import BlendPlan, GenerationConfig
from tests.helpers import PASSAGES, QUESTION

PLAN = BlendPlan(PASSAGES, QUESTION, mode="prefix_cache")


@pytest.fixture
def engine(tiny_runner):
    eng = BlendEngine(tiny_runner, MemoryStore(1 << 30, kv_format="fp32"), EngineConfig(kv_format="fp32"))
    yield eng
    eng.close()


@pytest.fixture
def events(monkeypatch):
    """What happened, in order: "token", "end" (the caller's side), "save" issued, "copied" (the
    saver thread past the copy's completion), "wait" (a request asking for an entry in flight).
    The copy completes only once `events.gate` is set."""
    class Events(list):
        gate = threading.Event()

    log = Events()

    def wrap(cls, name, label, before=None):
        orig = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            if before is not None:
                before(self, *args)
            if label is not None:
                log.append(label)
            return orig(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapped)

    wrap(Generation, "emit", "token")
    wrap(Generation, "end", "end")
    wrap(PrefixCache, "save", "save")
    wrap(HostCopy, "kv", "copied", before=lambda self: log.gate.wait(60))

    def settle(self, ck):
        if ck in self._pending:  # the next request needs an entry still being saved: let it finish
            log.append("wait")
            log.gate.set()

    wrap(PrefixCache, "_settle", None, before=settle)
    return log


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_the_first_token_and_the_answer_do_not_wait_for_the_save_and_the_next_request_reuses_it(
        engine, events, max_tokens):
    gen = GenerationConfig(max_tokens=max_tokens, ignore_eos=True, logprobs=0)  # logprobs: every token a delta
    first = engine.generate(PLAN, gen)
    deltas = first.deltas()
    next(deltas)
    assert events[0] == "token" and "copied" not in events  # the first token is out before any save
    list(deltas)
    assert first.result is not None and len(first.result.token_ids) == max_tokens
    mine = [e for e in events if e in ("token", "save", "end")]
    assert mine[:2] == ["token", "save"] and mine[-1] == "end"  # issued after the first token, before the result
    assert "copied" not in events and engine.prefix_cache.stats().entries == 0  # the answer did not wait for it

    second = engine.run(PLAN, gen)  # finds the entries in flight, waits for them, reuses them
    assert "wait" in events and events.count("copied") == len(PASSAGES) + 1  # the system prompt and each passage
    layout = first.state.layout
    # the saved entries cover every passage; the KV pool's own prefix cache may take more (every full block)
    assert second.report.prefix_tokens_reused >= layout.segments[-2].end
    assert second.token_ids == first.result.token_ids
    keys = engine.prepare(PLAN, max_tokens).keys
    for seg, ck, _ in PrefixCache.chain(layout.segments, keys):  # the entry is the first request's KV, bit for bit
        want, got = first.state.cache.segment(seg.offset, seg.end), engine.prefix_cache.store.get(ck)
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def test_a_prefill_on_the_calling_thread_saves_after_its_logits_and_the_next_one_reuses_it(engine, events):
    """`BlendEngine.prefill` (benchmarks, tests) issues the save at its end; the copy completes later."""
    events.gate.set()
    first = engine.prefill(PLAN)
    assert events[:1] == ["save"]
    again = engine.prefill(PLAN)
    assert again.report.prefix_tokens_reused == first.layout.segments[-2].end
    assert (again.logits - first.logits).abs().max().item() < 1e-4


def test_drain_returns_once_every_save_in_flight_is_stored(engine, events):
    """Benchmarks drain after each timed request, so a save is never inside the next one's time."""
    engine.prefill(PLAN)  # the save is issued; its copy waits at the gate
    assert "save" in events and engine.prefix_cache.stats().entries == 0
    drained = threading.Thread(target=engine.prefix_cache.drain)
    drained.start()
    drained.join(timeout=0.2)
    assert drained.is_alive()  # still waiting: the gate is closed, so no entry can be stored yet
    events.gate.set()
    drained.join(timeout=60)
    assert not drained.is_alive()
    assert engine.prefix_cache.stats().entries == len(PASSAGES) + 1  # the system prompt and each passage


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the save stream and pinned memory need a CUDA device")
def test_on_cuda_a_segment_crosses_in_one_copy_to_pinned_memory_on_the_one_save_stream():
    cache = KVCache(3, 2, 40, 8, torch.float16, "cuda")
    for t in (*cache.k, *cache.v):
        t.normal_()
    want = cache.segment(5, 17)  # [L, H, T, D] each, on the device
    torch.cuda.set_sync_debug_mode("error")  # issuing the copy never waits for the device
    try:
        copy = copy_to_host(cache, 5, 17)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = copy.kv()  # waits for the copy's event
    assert copy.block.is_pinned() and copy.done is not None and copy.block.shape == (2, 3, 2, 12, 8)
    assert torch.equal(got.k, want.k.cpu()) and torch.equal(got.v, want.v.cpu())
    assert save_stream(cache.k[0].device) is save_stream(torch.device("cuda", torch.cuda.current_device()))
