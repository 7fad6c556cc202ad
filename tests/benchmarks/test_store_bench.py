"""The store benchmark measures what it says: every run is served from the store under test."""

from __future__ import annotations

from benchmarks.common.data import Context
from benchmarks.kv_delivery.store import measure_formats, precompute_all
from tests.helpers import PASSAGES, QUESTION


def test_int8_cost_is_measured_on_cached_runs(tiny_runner):
    """A store key includes the stored format: filling the int8 store under fp16 keys (the bug this
    guards) made every int8 run a cache miss, recomputed, and 'int8 cost' was recompute's effect
    (0.38 KL at full_reuse on the 4K contexts). measure_formats now keys each store itself and stops
    on a miss; on cached runs int8 costs little."""
    contexts = [Context(question=QUESTION, passages=PASSAGES, n_tokens=0),
                Context(question="Where is the Louvre?", passages=PASSAGES[::-1], n_tokens=0)]
    out = measure_formats(tiny_runner, contexts, precompute_all(tiny_runner, contexts))
    assert out["bytes_per_token"]["int8"] < 0.6 * out["bytes_per_token"]["fp16"]
    assert 0.0 <= out["kl_int8_vs_fp16_full_reuse"] < 0.01
    assert 0.0 <= out["kl_int8_vs_fp16"] < 0.05
    assert len(out["kl_per_context"]) == 2


def test_each_tier_reports_its_layers_load_wait_and_compute(tiny_runner, tmp_path):
    """Issue #57 item 2: per layer, the load, how long compute waited for it and the compute; without
    read-ahead compute waits for every load (its wait is the load itself)."""
    from benchmarks.kv_delivery.store import measure_tiers

    contexts = [Context(question=QUESTION, passages=PASSAGES, n_tokens=0)]
    tiers = {(t.tier, t.prefetch_depth): t for t in measure_tiers(tiny_runner, contexts,
                                                                  precompute_all(tiny_runner, contexts), tmp_path,
                                                                  trials=1)}
    n = tiny_runner.shape.n_layers
    for t in tiers.values():
        assert len(t.layer_load_ms) == len(t.layer_wait_ms) == len(t.layer_compute_ms) == n
        assert all(x >= 0 for x in t.layer_load_ms + t.layer_wait_ms) and all(x > 0 for x in t.layer_compute_ms)
        assert 0.0 <= t.waited_share <= 1.0
    inline = tiers["disk", 0]
    assert inline.layer_wait_ms == inline.layer_load_ms  # read on the consumer's thread: all of it waited
