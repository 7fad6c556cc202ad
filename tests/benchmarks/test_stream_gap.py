"""The stream-gap benchmark's pure parts: SSE events from lines, gaps between deltas, pooled
percentiles, the verdict against the 1.2x target (no server)."""

from __future__ import annotations

import gc
import math
import time

import pytest

from benchmarks.common.client_gc import no_gc_pauses
from benchmarks.load.stream_gap import (
    TARGET,
    GapStats,
    Row,
    SseParser,
    gaps_ms,
    long_gaps,
    pooled_gaps,
    ratio,
    verdicts,
)


def events(lines: list[str]) -> list[tuple[str, str]]:
    parser = SseParser()
    return [e for e in map(parser.feed, lines) if e is not None]


def test_sse_events_end_at_a_blank_line():
    lines = ['event: sources', 'data: {"sources": []}', '', 'event: delta', 'data: {"text": "Paris"}', '',
             ': a comment', 'event: delta', 'data:{"text": " is"}', '\r', 'data: a', 'data: b', '', '', 'event: done',
             'data: {"stats": {}}', '']
    assert events(lines) == [("sources", '{"sources": []}'), ("delta", '{"text": "Paris"}'), ("delta", '{"text": " is"}'),
                             ("message", "a\nb"), ("done", '{"stats": {}}')]


def test_an_event_without_its_blank_line_is_not_returned():
    assert events(["event: delta", "data: x"]) == []


def test_gaps_are_between_consecutive_stamps_and_never_span_streams():
    assert gaps_ms([1.0, 1.02, 1.05]) == pytest.approx([20.0, 30.0])
    assert gaps_ms([1.0]) == [] and gaps_ms([]) == []
    assert pooled_gaps([[0.0, 0.01], [5.0, 5.1, 5.3]]) == pytest.approx([10.0, 100.0, 200.0])


def test_long_gaps_carry_the_wall_clock_time_of_their_end():
    offset = time.mktime((2026, 12, 6, 17, 33, 12, 0, 0, -1)) - 5.0  # perf_counter 5.0 = 17:33:12.000 local
    got = long_gaps([[4.0, 4.05, 5.0], [5.1, 5.3521]], offset)
    assert got == [("17:33:12.000", pytest.approx(950.0)), ("17:33:12.352", pytest.approx(252.1))]
    assert long_gaps([[1.0, 1.05]], offset) == []  # 50 ms: not long


def test_the_client_runs_its_timed_block_without_collections_and_restores_the_collector():
    assert gc.isenabled()
    with no_gc_pauses():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with no_gc_pauses():
            pass
        assert not gc.isenabled()  # off before: off after
    finally:
        gc.enable()


def test_gap_stats_are_percentiles_of_the_pooled_gaps():
    s = GapStats.of([float(v) for v in range(1, 101)])  # 1..100 ms
    assert s.n == 100 and s.max_ms == 100.0
    assert (s.p50_ms, s.p90_ms, s.p99_ms) == pytest.approx((50.5, 90.1, 99.01))
    empty = GapStats.of([])
    assert empty.n == 0 and math.isnan(empty.p99_ms)


def _row(name: str, p99: float, reranker: bool = True) -> Row:
    gaps = GapStats(10, p99 / 2, p99, p99, p99)
    return Row(name, reranker, 8 if name.startswith("loaded") else 0, 1, gaps, [100.0], [64], 1.0, gaps,
               20.0, 10, 0, float("nan"))


def test_verdicts_pair_each_loaded_row_with_its_quiet_one():
    rows = [_row("quiet", 40.0), _row("loaded", 40.0 * TARGET), _row("quiet (no rerank)", 40.0, False),
            _row("loaded (no rerank)", 100.0, False)]
    out = verdicts(rows)
    assert len(out) == 2
    assert "1.20x" in out[0] and ": met" in out[0]
    assert out[1].startswith("loaded (no rerank) (reranker off)") and "2.50x" in out[1] and "NOT met" in out[1]
    assert math.isnan(ratio(1.0, 0.0))
