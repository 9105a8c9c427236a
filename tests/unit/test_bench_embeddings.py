"""The embeddings benchmark's own arithmetic (the benchmark itself is a tool, not a test)."""

from __future__ import annotations

import math

from bench.embeddings import Level, make_sentences, mean_batch, rows


def test_mean_batch_is_texts_per_execute_between_two_snapshots():
    before = {"inference_count": "10", "execution_count": "10"}
    after = {"inference_count": "74", "execution_count": "14"}  # 64 texts in 4 executes
    assert mean_batch(before, after) == 16.0
    assert mean_batch({}, {"inference_count": "3", "execution_count": "3"}) == 1.0  # first use
    assert math.isnan(mean_batch(after, after))


def test_sentences_are_seeded_and_vary_in_length():
    assert make_sentences(8, seed=1) == make_sentences(8, seed=1) != make_sentences(8, seed=2)
    lengths = {len(s.split()) for s in make_sentences(64)}
    assert min(lengths) >= 6 and max(lengths) <= 30 and len(lengths) > 10


def test_the_report_compares_each_level_with_batching_off():
    levels = [
        Level("batching on", 32, 100, 1.0, 50.0, 90.0, 16.0, 0),
        Level("batching off", 32, 100, 4.0, 400.0, 700.0, 1.0, 0),
    ]
    table = rows(levels)
    assert [row[0] for row in table] == ["batching off", "batching on"]
    assert [row[3:5] for row in table] == [("25", "1.00"), ("100", "4.00")]
