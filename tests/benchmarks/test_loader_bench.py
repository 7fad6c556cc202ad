"""The loader benchmark end to end on tiny chunks: every row measured, ratios of paired runs."""

from __future__ import annotations

import benchmarks.kv_delivery.loader as bench


def test_loader_benchmark_measures_every_path_on_tiny_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "SHAPE", {"n_layers": 3, "n_heads": 2, "head_dim": 16, "n_tokens": 40})
    result = bench.run(n_chunks=3, reps=2, formats=("fp16", "int8"), workdir=tmp_path)
    assert [r["format"] for r in result["results"]] == ["fp16", "int8"]
    for r in result["results"]:
        assert r["bytes"] == 3 * 3 * r["layer_bytes_per_chunk"]
        for row in ("disk_warm", "disk_cold", "memory", "memory_ring"):
            assert len(r[row]["pairs"]) == 2 and r[row]["tier"] > 0 and r[row]["raw"] > 0
            assert min(t / w for w, t in r[row]["pairs"]) <= r[row]["ratio"] <= max(t / w for w, t in r[row]["pairs"])
        assert r["disk_cold"]["dropped_with"] == "fadvise"
    table = bench.format_table(result["results"])
    assert "| int8 | memory |" in table and "| fp16 | memory_ring |" in table
    assert not list(tmp_path.iterdir())  # the chunk files are removed
