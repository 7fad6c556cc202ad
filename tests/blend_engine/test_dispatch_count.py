"""The fixed cost of a request, counted (issue #57 item 1): ops per layer (load, place and pass) do
not grow with the number of passages, and nothing inside the layer loop reads a device value on the
host, for a blend, a full prefill and a decode step (`executor.dispatch_count`, driven by
`benchmarks.kernels.dispatch_count` through the engine's own paths, on an 8-layer random Llama). The one
exception, measured: `selected_attention="blocks"` reads once per selection set."""

from __future__ import annotations

import threading

import pytest
import torch

from benchmarks.kernels.dispatch_count import (
    QUESTION,
    TINY,
    RequestCount,
    cache_passages,
    count_request,
    engine_for,
    synthetic_passages,
)
from blend_engine.executor import layers
from blend_engine.executor.dispatch_count import DispatchCount, reads_host
from blend_engine.executor.layers import LayerHooks
from blend_engine.types import BlendPlan
from tests.helpers import tiny_runner

SIZES = (3, 10, 30)


@pytest.fixture(scope="module")
def runner(real_runner):
    return tiny_runner(real_runner.tokenizer, name="tiny-8", vocab_size=len(real_runner.tokenizer), **TINY)


@pytest.fixture(scope="module", params=["auto", "sdpa_mask"])
def counts(request, runner) -> dict[tuple[str, int], RequestCount]:
    """Per (mode, passages): one request counted; "auto" is the CPU's path (its C++ kernels),
    "sdpa_mask" the one a device takes."""
    eng = engine_for(runner, request.param)
    passages = synthetic_passages(max(SIZES))
    out = {}
    try:
        for n in SIZES:
            for mode in ("blend", "full_prefill"):
                plan = BlendPlan(passages[:n], QUESTION, mode=mode, recompute_ratio=0.15)
                cache_passages(eng, plan)
                out[mode, n] = count_request(eng, plan)
    finally:
        eng.close()
    return out


def _per_layer(counts, mode: str, part: str) -> dict[int, list[int]]:
    """passages -> load + place + pass ops of each layer."""
    return {n: [getattr(counts[mode, n], part).total_ops(layer) for layer in range(TINY["num_hidden_layers"])]
            for n in SIZES}


@pytest.mark.parametrize("mode", ["blend", "full_prefill"])
def test_prefill_ops_per_layer_do_not_grow_with_passages(counts, mode):
    per = _per_layer(counts, mode, "prefill")
    assert per[3] == per[10] == per[30], per
    assert counts[mode, 30].tokens > 4 * counts[mode, 3].tokens  # the prompts really differ


def test_blend_places_every_chunk_in_one_op_a_layer(counts):
    """Below the check layer nothing is placed (every row is recomputed); from it on, one op a
    layer writes every chunk, rotated, whatever their number."""
    for n in SIZES:
        places = [layer["place"] for layer in counts["blend", n].prefill.layers]
        assert places[0] == 0 and set(places[1:]) == {1}, (n, places)


def test_blend_loads_every_chunk_with_the_same_ops_a_layer(counts):
    """The loader's layer (on the CPU read on the compute thread): every chunk's blob gathered into
    one block by numpy, then the same few ops whatever the number of chunks; nothing loaded below
    the check layer."""
    loads = {n: [layer["load"] for layer in counts["blend", n].prefill.layers] for n in SIZES}
    assert loads[3] == loads[10] == loads[30], loads
    assert loads[3][0] == 0 and max(loads[3][3:]) <= 2, loads[3]  # after the ring's set-up: k and v of the block


def test_decode_step_ops_per_layer_do_not_grow_with_context(counts):
    per = _per_layer(counts, "blend", "decode")
    assert per[3] == per[10] == per[30], per


@pytest.mark.parametrize("mode", ["blend", "full_prefill"])
def test_no_host_read_inside_the_layer_loop(counts, mode):
    for n in SIZES:
        c = counts[mode, n]
        assert c.prefill.reads_inside == [], (mode, n, c.prefill.reads_inside)
        assert c.decode.reads_inside == [], (mode, n, c.decode.reads_inside)


def test_a_blend_reads_its_final_positions_once_after_the_loop(counts):
    """The one host read a prefill makes is after the loop: the counter sees it there."""
    assert counts["blend", 3].prefill.reads_outside == ["Tensor.tolist"]


def test_blocks_read_the_host_once_per_selection_set(runner):
    """`selected_attention="blocks"` (the CPU's SDPA fallback) cannot keep its shapes on the device:
    each block reads the keys up to its last selected position, a data-dependent bound. Measured
    here: one read per selection set (the check layer and the schedule's), none elsewhere; its
    load and place ops stay flat, and full prefill and the decode step read nothing."""
    from blend_engine.scheduler.budget import narrowing

    eng = engine_for(runner, "blocks")
    passages = synthetic_passages(30)
    out = {}
    try:
        for n in (3, 30):
            for mode in ("blend", "full_prefill"):
                plan = BlendPlan(passages[:n], QUESTION, mode=mode, recompute_ratio=0.15)
                cache_passages(eng, plan)
                out[mode, n] = count_request(eng, plan)
        selecting = sorted(narrowing(eng.config.policy))  # the check layer and the schedule's layers
    finally:
        eng.close()
    for n in (3, 30):
        assert out["blend", n].prefill.reads_inside == [f"{layer}/pass: Tensor.tolist" for layer in selecting]
        assert out["full_prefill", n].prefill.reads_inside == []
        assert out["blend", n].decode.reads_inside == out["full_prefill", n].decode.reads_inside == []
    flat = {n: [(x["load"], x["place"]) for x in out["blend", n].prefill.layers] for n in (3, 30)}
    assert flat[3] == flat[30], flat


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8"])
def test_one_block_load_places_what_the_per_chunk_load_placed(runner, monkeypatch, fmt):
    """The CPU's load of a layer as one block (`transfer.HostGather`) against the per-chunk
    decode and copy it replaced: the same cache bit for bit, the same selection and logits."""
    from blend_engine.engine import BlendEngine, EngineConfig
    from blend_engine.kv_store import MemoryStore
    from blend_engine.transfer import HostGather

    def blend(per_chunk: bool):
        if per_chunk:
            monkeypatch.setattr(HostGather, "__call__", lambda self, staged: None)
        eng = BlendEngine(runner, MemoryStore(1 << 28, kv_format=fmt),
                          EngineConfig(kv_format=fmt, prefix_caching=False))
        try:
            plan = BlendPlan(synthetic_passages(10), QUESTION, recompute_ratio=0.15)
            cache_passages(eng, plan)
            with torch.inference_mode():
                return eng.prefill(plan)
        finally:
            eng.close()
            monkeypatch.undo()

    new, old = blend(False), blend(True)
    n = new.layout.n_tokens
    assert torch.equal(new.logits, old.logits)
    assert new.report.recomputed_positions == old.report.recomputed_positions
    for layer in range(TINY["num_hidden_layers"]):
        assert torch.equal(new.cache.k[layer][:, :n], old.cache.k[layer][:, :n]), layer
        assert torch.equal(new.cache.v[layer][:, :n], old.cache.v[layer][:, :n]), layer


# ---------------------------------------------------------------- the counter itself
class _Peeking(LayerHooks):
    """A research hook that reads a placed value on the host: what the target forbids."""

    def placed(self, layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
        K[:, :1].sum().tolist()


def test_counter_attributes_a_host_read_to_its_layer_and_phase(runner):
    eng = engine_for(runner)
    try:
        plan = BlendPlan(synthetic_passages(3), QUESTION, recompute_ratio=0.15)
        cache_passages(eng, plan)
        with DispatchCount() as count:
            eng.prefill(plan, hooks=_Peeking())
    finally:
        eng.close()
    inside = [(r.layer, r.phase, r.what) for r in count.host_reads()]
    assert inside == [(layer, "place", "Tensor.tolist") for layer in range(TINY["num_hidden_layers"])]
    assert layers._watch is None  # counting is off again: serving marks nothing


def test_counter_counts_ops_on_its_own_thread_only():
    """A loader's reader thread (a GPU's) is not the compute thread: its ops are not counted."""
    other = threading.Thread(target=lambda: torch.zeros(8).add_(1).sum())
    with DispatchCount() as count:
        x = torch.ones(4) + 1  # two ops: ones, add
        other.start()
        other.join()
    torch.ones(3)  # after: not counted
    assert count.op_counts(None) == {"aten::ones": 1, "aten::add": 1} and x.shape == (4,)


@pytest.mark.parametrize("fn, what", [
    (lambda t: t[t > 1], "aten::index"),  # a boolean mask: the result's length is data
    (lambda t: t.nonzero(), "aten::nonzero"),
    (lambda t: torch.unique(t), "aten::_unique2"),
    (lambda t: t.repeat_interleave(t.long()), "aten::repeat_interleave"),
    (lambda t: t.sum().item(), "Tensor.item"),
    (lambda t: int(t[0]), "Tensor.__int__"),
    (lambda t: bool(t[0] > 0), "Tensor.__bool__"),
    (lambda t: t.tolist(), "Tensor.tolist"),
])
def test_counter_flags_every_kind_of_host_read(fn, what):
    t = torch.tensor([0.0, 1.0, 2.0, 3.0])
    with DispatchCount() as count:
        fn(t)
    assert [r.what for r in count.host_reads(inside=False)] == [what]


def test_counter_does_not_flag_device_side_selection():
    """topk, sort, gather by an index tensor, index_put by an index tensor: shapes known up front."""
    t = torch.tensor([3.0, 1.0, 2.0, 0.0])
    with DispatchCount() as count:
        rows = torch.topk(t, 2).indices.sort().values
        t[rows] = t[rows] * 2
        torch.where(t > 1, t, 0.0)
    assert count.host_reads(inside=False) == []
    assert not reads_host("aten::index", (t, [rows]), {})
