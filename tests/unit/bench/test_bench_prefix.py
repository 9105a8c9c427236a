"""make bench-prefix's own arithmetic: the budget it writes and the ratio it reports."""

from __future__ import annotations

import pytest

from bench.prefix import _median_ratio, _set_parameter


def test_the_budget_lands_in_the_engine_config(tmp_path):
    config = tmp_path / "tensorrt_llm" / "config.pbtxt"
    config.parent.mkdir()
    config.write_text('parameters { key: "prefix_cache_mb" value: { string_value: "256" } }')
    _set_parameter(tmp_path, "prefix_cache_mb", 113.7)
    assert config.read_text() == (
        'parameters { key: "prefix_cache_mb" value: { string_value: "113.7" } }'
    )
    with pytest.raises(KeyError, match="no parameter enable_chunked_context"):
        _set_parameter(tmp_path, "enable_chunked_context", "false")


def test_the_no_prefix_ratio_is_of_medians_over_alternated_rounds():
    rounds = [
        {"system": "off", "output_tokens_per_s": 100.0},
        {"system": "on", "output_tokens_per_s": 90.0},
        {"system": "off", "output_tokens_per_s": 120.0},
        {"system": "on", "output_tokens_per_s": 118.0},
        {"system": "off", "output_tokens_per_s": 110.0},
        {"system": "on", "output_tokens_per_s": 110.0},
    ]
    assert _median_ratio(rounds, "output_tokens_per_s") == 1.0
    assert _median_ratio([], "output_tokens_per_s") is None


def test_each_round_has_its_own_conversations_and_the_table_is_of_medians():
    from bench.prefix import _medians, conversation_prompts

    first = conversation_prompts(2, 3, 50, seed=0)
    again = conversation_prompts(2, 3, 50, seed=1)
    assert len(first) == 6 and first[2].startswith(first[0])  # turn 2 resends turn 1
    assert not {p[:20] for p in first} & {p[:20] for p in again}  # no block in common
    rounds = [
        {"system": "off", "ttft_p50_ms": t, "ttft_p99_ms": 1.0, "output_tokens_per_s": 1.0}
        | {"prefill_tokens": 1.0, "hit_rate": 0.0}
        for t in (300.0, 100.0, 200.0)
    ]
    assert _medians(rounds, ["off", "routed"]) == {
        "off": {
            "ttft_p50_ms": 200.0,
            "ttft_p99_ms": 1.0,
            "output_tokens_per_s": 1.0,
            "prefill_tokens": 1.0,
            "hit_rate": 0.0,
        }
    }
