"""The embeddings benchmark's own arithmetic (the benchmark itself is a tool, not a test)."""

from __future__ import annotations

import math

from bench.embeddings import Level, counts, make_sentences, rows, speedup


def test_counts_are_the_differences_of_two_statistics_snapshots():
    before = {"inference_count": "10", "execution_count": "10"}
    after = {"inference_count": "74", "execution_count": "14"}  # 64 texts in 4 executes
    assert counts(before, after) == (64, 4)
    assert counts({}, before) == (10, 10)  # a model's first use has no counters yet


def test_rounds_pool_into_one_level():
    level = Level("batching on", 32)
    level.add(Level("batching on", 32, 64, 2.0, 64, 4, 0, [0.1] * 64))
    level.add(Level("batching on", 32, 32, 6.0, 32, 12, 1, [0.3] * 32))
    assert level.requests_per_s == 12.0  # 96 requests in 8 s
    assert level.mean_batch == 6.0  # 96 texts in 16 executes
    assert level.p50_ms == 100.0 and level.p99_ms == 300.0 and level.errors == 1
    assert math.isnan(Level("batching off", 1).mean_batch)


def test_sentences_are_seeded_and_vary_in_length():
    assert make_sentences(8, seed=1) == make_sentences(8, seed=1) != make_sentences(8, seed=2)
    lengths = {len(s.split()) for s in make_sentences(64)}
    assert min(lengths) >= 6 and max(lengths) <= 30 and len(lengths) > 10


def test_the_report_compares_each_level_with_batching_off():
    levels = [
        Level("batching on", 32, 100, 1.0, 100, 6, 0, [0.05] * 100),
        Level("batching off", 32, 100, 4.0, 100, 100, 0, [0.4] * 100),
    ]
    table = rows(levels)
    assert [row[0] for row in table] == ["batching off", "batching on"]
    assert [row[3:5] for row in table] == [("25", "1.00"), ("100", "4.00")]


def test_the_speedup_is_the_median_of_back_to_back_rounds():
    on, off = Level("batching on", 32), Level("batching off", 32)
    # Round 3 of "off" ran during a burst of load elsewhere: one pair is skewed, not the figure.
    for on_s, off_s in ((1.0, 2.0), (1.0, 3.0), (1.0, 10.0)):
        on.add(Level("batching on", 32, 10, on_s, 10, 1, 0, [on_s]))
        off.add(Level("batching off", 32, 10, off_s, 10, 10, 0, [off_s]))
    assert on.round_rates == [10.0, 10.0, 10.0]
    assert speedup(on, off) == 3.0  # pooled it would be 15 / 3 = 5.0
