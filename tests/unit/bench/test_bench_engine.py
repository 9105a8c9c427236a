"""The engine benchmark's own arithmetic (the benchmark itself is a tool, not a test)."""

from __future__ import annotations

from bench.common import percentile
from bench.engine import Level, check_targets, queued_ahead


def test_queued_ahead_counts_earlier_requests_still_waiting_for_a_first_token():
    # (sent, first token): b is sent while a waits; c after a got its token but b waits.
    spans = [(0.0, 1.0), (0.5, 2.0), (1.5, 2.5)]
    assert queued_ahead(spans) == [0, 1, 1]


def test_percentile_picks_from_the_sorted_values():
    assert percentile([5, 1, 3], 0.5) == 3
    assert percentile([5, 1, 3], 1.0) == 5


def level(concurrency, tokens_per_s, ttft, itl=40.0, queued=0.0):
    return Level("x", concurrency, 10, int(tokens_per_s * 10), 10.0, ttft, ttft, itl, 0, queued)


def test_targets_compare_concurrency_16_with_the_baseline_and_concurrency_1():
    baseline = level(1, 50, 40)
    lines = check_targets(baseline, [level(1, 45, 60), level(16, 300, 300, itl=40, queued=4)])
    assert lines[0].startswith("PASS") and "6.00x" in lines[0]
    # TTFT bound: 1.5 x 60 ms + 4 queued prefills x 40 ms = 250 ms, against 300 ms.
    assert lines[1].startswith("MISS") and "= 250 ms" in lines[1]
    fast = check_targets(baseline, [level(1, 45, 60), level(16, 200, 200, queued=4)])
    assert fast[0].startswith("MISS") and fast[1].startswith("PASS")
