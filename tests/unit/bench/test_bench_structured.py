"""make bench-structured's own logic: its prompts and schemas, its request bodies, the
answers' figures, the ratios and the target (the benchmark itself is a tool:
tests/integration/test_bench_structured.py runs a smoke)."""

from __future__ import annotations

import asyncio
import json
import math

import jsonschema
import pytest

from bench.loadgen import RequestRecord, _read_events
from bench.structured import (
    PERSON_SCHEMA,
    ChatTarget,
    answer_figures,
    chat_prompts,
    check_targets,
    comparable_lengths,
    pooled,
    ratios,
    response_format,
    wide_schema,
)
from tests.unit.bench.test_bench_serving import FakeResponse


def test_the_prompts_vary_and_repeat_for_a_seed():
    prompts = chat_prompts(32, seed=3)
    assert prompts == chat_prompts(32, seed=3) and prompts != chat_prompts(32, seed=4)
    assert len({p.text for p in prompts}) > 8 and len({p.seed for p in prompts}) == 32
    assert all("JSON" in p.text for p in prompts)


@pytest.mark.parametrize("fields", [1, 8, 20])
def test_the_wide_schema_has_the_fields_asked_all_required_and_valid(fields):
    schema = wide_schema(fields)
    jsonschema.validators.validator_for(schema).check_schema(schema)
    assert len(schema["properties"]) == fields and schema["required"] == list(schema["properties"])
    kinds = {json.dumps(v, sort_keys=True) for v in schema["properties"].values()}
    assert len(kinds) == min(fields, 7)  # strings, numbers, enums, lists, objects...
    assert set(wide_schema(fields, salt=1)["properties"]).isdisjoint(schema["properties"])


def test_the_schemas_compile_with_the_projects_guide_check():
    from tritonllm.guided import grammar

    for schema in (PERSON_SCHEMA, wide_schema(20)):
        grammar("json_schema", json.dumps(schema))


def test_the_chat_body_carries_the_prompts_seed_and_the_conditions_format():
    prompt = chat_prompts(1)[0]
    free = ChatTarget("free", "http://x", "m", 1.0)
    constrained = ChatTarget("json", "http://x", "m", 1.0, response_format(PERSON_SCHEMA))
    body = free.body(prompt, 128)
    assert body["messages"] == [{"role": "user", "content": prompt.text}]
    assert (body["seed"], body["temperature"], body["max_tokens"]) == (prompt.seed, 1.0, 128)
    assert "response_format" not in body and "min_tokens" not in body
    evened = ChatTarget("free", "http://x", "m", 1.0, min_tokens=128)
    assert evened.body(prompt, 128)["min_tokens"] == 128
    assert evened.body(prompt, 16)["min_tokens"] == 16  # never above max_tokens
    assert constrained.body(prompt, 128)["response_format"]["json_schema"]["schema"] == (
        PERSON_SCHEMA
    )
    assert constrained.path == "/v1/chat/completions"
    for target in (free, constrained, evened):
        asyncio.run(target.aclose())


def test_chat_events_give_the_content_its_arrivals_and_the_finish_reason():
    def event(delta, finish=None):
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return "data: " + json.dumps({"choices": [choice]})

    record = RequestRecord(sent=0.0)
    lines = [
        event({"role": "assistant", "content": ""}),
        event({"content": '{"a": '}),
        event({"content": "1}"}),
        event({}, "stop"),
        'data: {"choices": [], "usage": {"completion_tokens": 4}}',
        "data: [DONE]",
    ]
    asyncio.run(_read_events(FakeResponse(lines), record))
    assert (record.text, record.finish_reason, record.tokens) == ('{"a": 1}', "stop", 4)
    assert len(record.arrivals) == 2 and record.error is None
    target = ChatTarget("free", "http://x", "m", 1.0)
    empty = RequestRecord(sent=0.0, arrivals=[0.1])
    target.check(empty, 128)  # any length is an answer, none is not
    assert empty.error == "no tokens"
    target.check(record, 128)
    assert record.error is None
    asyncio.run(target.aclose())


def answer(text, finish="stop", tokens=10, **kw):
    return RequestRecord(sent=0.0, arrivals=[0.1, 0.2], end=0.3, tokens=tokens, text=text,
                         finish_reason=finish, **kw)  # fmt: skip


def test_answer_figures_count_stops_json_and_schema_valid_answers_of_the_completed():
    valid = {"name": "Ann", "age": 3}
    schema = {"type": "object", "required": ["name", "age"]}
    records = [
        answer(json.dumps(valid)),
        answer(json.dumps({"name": "Bo"})),  # JSON, not the schema's
        answer('{"name": "Cy', finish="length", tokens=30),  # cut
        answer("", tokens=0, error="HTTP 500"),  # not completed: not counted
    ]
    figures = answer_figures(records, schema)
    assert figures["stop_share"] == pytest.approx(2 / 3)
    assert figures["json_share"] == pytest.approx(2 / 3)
    assert figures["schema_valid_share"] == pytest.approx(1 / 3)
    assert figures["tokens_per_answer"] == pytest.approx(50 / 3)
    assert math.isnan(answer_figures([], schema)["stop_share"])


def test_pooled_joins_a_conditions_rounds_and_sums_their_cpu():
    def round_(condition, seconds, engine_s, texts):
        records = [answer(t) for t in texts]
        return {"condition": condition, "records": records, "seconds": seconds,
                "cpu_s": {"engine": engine_s, "load generator": 1.0}}  # fmt: skip

    rounds = [
        round_("free", 1.0, 0.1, ["a", "b"]),
        round_("json_schema", 2.0, 0.3, ["{}", "{}"]),
        round_("free", 1.0, 0.1, ["c", "d"]),
    ]
    free = pooled("free", rounds, {"type": "object"})
    assert (free["rounds"], free["requests"], free["seconds"]) == (2, 4, 2.0)
    assert free["output_tokens_per_s"] == pytest.approx(20.0)  # 40 tokens in 2 s
    assert free["cpu_s"] == {"engine": 0.2, "load generator": 2.0}
    assert free["cpu_ms_per_token"] == {"engine": pytest.approx(5.0)}  # the client apart
    assert free["json_share"] == 0
    constrained = pooled("json_schema", rounds, {"type": "object"})
    assert constrained["schema_valid_share"] == 1.0


def test_ratios_and_the_ten_percent_target():
    free = {"output_tokens_per_s": 100.0, "itl_p50_ms": 10.0, "tpot_p50_ms": 10.0,
            "ttft_p50_ms": 50.0, "tokens_per_answer": 100.0,
            "cpu_ms_per_token": {"engine": 2.0}}  # fmt: skip
    cheap = {"output_tokens_per_s": 95.0, "itl_p50_ms": 10.5, "tpot_p50_ms": 12.0,
             "ttft_p50_ms": 55.0, "tokens_per_answer": 90.0,
             "cpu_ms_per_token": {"engine": 2.2}}  # fmt: skip
    ratio = ratios(free, cheap)
    assert ratio == pytest.approx(
        {"tokens_per_s": 0.95, "itl_p50": 1.05, "tpot_p50": 1.2, "ttft_p50": 1.1,
         "tokens_per_answer": 0.9, "engine_cpu_per_token": 1.1}
    )  # fmt: skip
    assert comparable_lengths(ratio)
    assert not comparable_lengths(ratios(free, cheap | {"tokens_per_answer": 30.0}))
    assert [c["pass"] for c in check_targets(ratio)] == [True, True]
    costly = ratios(free, cheap | {"output_tokens_per_s": 85.0, "itl_p50_ms": 11.5})
    assert [c["pass"] for c in check_targets(costly)] == [False, False]
    assert [c["pass"] for c in check_targets(costly, max_cost=0.2)] == [True, True]
    nothing = ratios(free | {"output_tokens_per_s": 0.0, "cpu_ms_per_token": {}}, cheap)
    assert math.isnan(nothing["tokens_per_s"]) and "engine_cpu_per_token" not in nothing
    assert not check_targets(nothing)[0]["pass"]
