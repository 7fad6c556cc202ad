"""The stream-gap benchmark's pure parts: SSE events from lines, gaps between deltas, pooled
percentiles, the verdict against the 1.2x target (no server)."""

from __future__ import annotations

import math

import pytest

from benchmarks.load.stream_gap import TARGET, GapStats, Row, SseParser, gaps_ms, pooled_gaps, ratio, verdicts


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
