"""make bench-prefix's own arithmetic: the budget it writes and the ratio it reports."""

from __future__ import annotations

import pytest

from bench.common import set_engine_parameter
from bench.prefix import SYSTEMS, _median_ratio, parse_args, tenant_prompts


def test_the_budget_lands_in_the_engine_config(tmp_path):
    config = tmp_path / "tensorrt_llm" / "config.pbtxt"
    config.parent.mkdir()
    config.write_text('parameters { key: "prefix_cache_mb" value: { string_value: "256" } }')
    set_engine_parameter(tmp_path, "prefix_cache_mb", 113.7)
    assert config.read_text() == (
        'parameters { key: "prefix_cache_mb" value: { string_value: "113.7" } }'
    )
    with pytest.raises(KeyError, match="no parameter enable_chunked_context"):
        set_engine_parameter(tmp_path, "enable_chunked_context", "false")


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
        {"system": "off", "ttft_p50_ms": t, "ttft_p90_ms": 1.0, "ttft_p99_ms": 1.0}
        | {"output_tokens_per_s": 1.0}
        | {"prefill_tokens": 1.0, "hit_rate": 0.0, "busiest_replica_share": 0.5}
        for t in (300.0, 100.0, 200.0)
    ]
    assert _medians(rounds, ["off", "routed"]) == {
        "off": {
            "ttft_p50_ms": 200.0,
            "ttft_p90_ms": 1.0,
            "ttft_p99_ms": 1.0,
            "output_tokens_per_s": 1.0,
            "prefill_tokens": 1.0,
            "hit_rate": 0.0,
            "busiest_replica_share": 0.5,
        }
    }


def test_the_counters_are_summed_over_replicas_with_the_busiest_ones_share():
    from bench.prefix import counted

    def replica(prefill, queried, hits):
        return {"prefill_tokens": prefill, "queried_tokens": queried, "hit_tokens": hits}

    before = {1: replica(10, 100, 90), 2: replica(0, 0, 0)}
    after = {1: replica(40, 400, 360), 2: replica(50, 100, 50), 3: replica(0, 500, 500)}
    assert counted(before, after) == {
        "prefill_tokens": 80,
        "queried_tokens": 900,  # 300 + 100 + 500 (3 started meanwhile)
        "hit_tokens": 820,
        "busiest_replica_share": 500 / 900,
    }


def test_the_tenants_workload_sends_every_conversation_each_round_under_its_system_prompt():
    prompts, systems = tenant_prompts(tenants=3, conversations=2, turns=3, system_words=50)
    assert len(systems) == 3 and len(set(systems)) == 3
    assert len(prompts) == 3 * 2 * 3
    rounds = [prompts[i * 6 : (i + 1) * 6] for i in range(3)]
    for turn, round_ in enumerate(rounds):
        assert all(p.count("\nUser: ") == turn + 1 for p in round_)
        owners = [next(s for s in systems if p.startswith(s)) for p in round_]
        assert sorted(owners) == sorted(systems * 2)  # each tenant's two conversations
    for prompt in rounds[2]:  # a later turn extends the same conversation's earlier ones
        assert sum(p.startswith(prompt.rsplit("\nUser: ", 1)[0]) for p in rounds[1]) == 1
    openings = [[p.split("\nUser: ")[0] for p in round_] for round_ in rounds]
    assert len({tuple(o) for o in openings}) > 1  # each round in its own order
    other, _ = tenant_prompts(tenants=3, conversations=2, turns=3, system_words=50, seed=1)
    assert not set(other) & set(prompts)


def test_systems_are_chosen_by_name_with_kv_aware_among_them():
    args = parse_args(["--systems", "on,kv", "--workload", "tenants"])
    assert args.systems == "on,kv" and SYSTEMS["kv"].routing == "kv_aware"


def test_the_ideal_hit_rate_is_what_one_cache_that_never_evicts_serves():
    from bench.prefix import ideal_hit_rate

    class Characters:  # a token per character
        def encode(self, text):
            return [ord(c) for c in text]

    first, again, other = "a" * 8 + "b" * 4, "a" * 8 + "c" * 4, "d" * 12
    # The second prompt finds the first's two full 4-token blocks; nothing else is held.
    assert ideal_hit_rate([first, again, other], Characters(), block_size=4) == 8 / 36
