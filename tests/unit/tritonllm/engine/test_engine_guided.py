"""Guided decoding in the torch engine: the real model, XGrammar's real matchers.

The default model may or may not write JSON well: the tests assert what guided decoding
guarantees whatever the model, that every answer is a prefix the grammar accepts and an
answer that ended with "stop" is whole and valid, with max_tokens generous enough for
a finished answer where the schema keeps it short.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from tests.unit.tritonllm.engine.test_engine import DTYPE, CollectingSink, request
from tests.unit.tritonllm.test_guided import tool_tag
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.sampling import SamplingParams
from tritonllm.engine.scheduler import Engine
from tritonllm.guided import grammar
from tritonllm.tokenization import InvalidRequest

PROMPT = "<|user|>Answer in JSON.<|assistant|>"

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
            },
            "level": {"enum": ["low", "mid", "high"]},
        },
        "required": ["user", "level"],
    },
    "array_of_numbers": {
        "type": "object",
        "properties": {"values": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
        "required": ["values"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": [True, None]}},
        "required": ["a"],
    },
    "any_of": {
        "anyOf": [
            {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
            {"enum": ["none", "all"]},
        ]
    },
    "short_string": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}},
        "required": ["name"],
    },
}


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    engine = Engine(
        CausalLMRunner(checkpoint_dir, dtype=DTYPE),
        max_batch_size=4,
        max_queue_size=16,
        prefix_cache_mb=4,
    )
    yield engine
    engine.shutdown()


def run(engine, tokenizer, guide_type, guide, max_tokens=120, seed=0, rid="g", **kwargs):
    sink = CollectingSink()
    sampling = kwargs.pop("sampling", SamplingParams(temperature=1.0, seed=seed))
    req = request(
        tokenizer,
        kwargs.pop("prompt", PROMPT),
        max_tokens,
        rid=rid,
        end_id=kwargs.pop("end_id", 2),
        exclude_input_in_output=True,
        sampling=sampling,
        guide_type=guide_type,
        guide=guide,
        **kwargs,
    )
    engine.submit(req, sink)
    return sink


def answer(sink, tokenizer) -> tuple[str, str]:
    assert sink.done.wait(120), "no final response"
    assert not sink.errors, sink.errors
    return tokenizer.decode(sink.tokens()), sink.chunks[-1].finish_reason


def accepted_prefix(guide_type: str, guide: str, text: str, whole: bool) -> bool:
    """Whether the grammar accepts ``text``: whole (then complete), or as the start of
    an answer (XGrammar's tokenizer-free test matcher, over the text's bytes)."""
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(grammar(guide_type, guide), text, require_termination=whole)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_are_valid_or_valid_prefixes(engine, tokenizer, name):
    guide = json.dumps(SCHEMAS[name])
    for seed in range(3):
        text, reason = answer(run(engine, tokenizer, "json_schema", guide, seed=seed), tokenizer)
        assert reason in ("stop", "length")
        assert accepted_prefix("json_schema", guide, text, whole=reason == "stop"), text
        if reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_greedy_enum_answer_is_whole(engine, tokenizer):
    schema = {"enum": ["red", "green", "blue"]}
    sink = run(engine, tokenizer, "json_schema", json.dumps(schema), sampling=SamplingParams())
    text, reason = answer(sink, tokenizer)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_regex_ebnf_and_json(engine, tokenizer):
    for seed in range(3):
        text, reason = answer(
            run(engine, tokenizer, "regex", r"[a-z]{2,5}-\d{2}", seed=seed), tokenizer
        )
        assert reason == "stop" and re.fullmatch(r"[a-z]{2,5}-\d{2}", text), text
        ebnf = 'root ::= ("yes" | "no") " because " [a-z]{1,8} "."'
        text, reason = answer(run(engine, tokenizer, "ebnf_grammar", ebnf, seed=seed), tokenizer)
        assert reason == "stop" and re.fullmatch(r"(yes|no) because [a-z]{1,8}\.", text), text
    text, reason = answer(run(engine, tokenizer, "json", "", max_tokens=60), tokenizer)
    assert accepted_prefix("json", "", text, whole=reason == "stop"), text
    if reason == "stop":
        json.loads(text)


def test_a_structural_tag_yields_tool_calls(engine, tokenizer):
    tag = tool_tag()
    text, reason = answer(run(engine, tokenizer, "structural_tag", tag, max_tokens=80), tokenizer)
    assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": '), text
    assert accepted_prefix("structural_tag", tag, text, whole=reason == "stop"), text
    calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
    for call in calls:
        assert json.loads(call)["name"] == "get_weather"


def test_constrained_and_free_rows_share_a_batch(engine, tokenizer):
    free = dict(sampling=SamplingParams(temperature=1.0, seed=5), prompt="The cat")
    alone = answer(run(engine, tokenizer, None, "", max_tokens=30, rid="free", **free), tokenizer)
    guide = json.dumps(SCHEMAS["nested"])
    sinks = [run(engine, tokenizer, "json_schema", guide, seed=i, rid=f"c{i}") for i in range(3)]
    together = run(engine, tokenizer, None, "", max_tokens=30, rid="free", **free)
    assert answer(together, tokenizer) == alone
    for sink in sinks:
        text, reason = answer(sink, tokenizer)
        assert accepted_prefix("json_schema", guide, text, whole=reason == "stop"), text


def test_the_same_seed_gives_the_same_answer_with_and_without_the_prefix_cache(
    engine, checkpoint_dir, tokenizer
):
    guide = json.dumps(SCHEMAS["array_of_numbers"])
    first = answer(run(engine, tokenizer, "json_schema", guide, seed=11), tokenizer)
    again = answer(run(engine, tokenizer, "json_schema", guide, seed=11), tokenizer)  # cached
    assert first == again
    plain = Engine(CausalLMRunner(checkpoint_dir, dtype=DTYPE), max_batch_size=2)
    try:
        assert answer(run(plain, tokenizer, "json_schema", guide, seed=11), tokenizer) == first
    finally:
        plain.shutdown()


def test_a_stop_word_ends_a_constrained_answer(engine, tokenizer):
    ebnf = 'root ::= [a-z]{1,6} "." [a-z]{1,20}'  # "." is a token of its own
    stop = tuple(tokenizer.encode(".", add_special_tokens=False))
    for seed in range(3):
        sink = run(engine, tokenizer, "ebnf_grammar", ebnf, seed=seed, stop_words=(stop,))
        text, reason = answer(sink, tokenizer)
        assert reason == "stop" and re.fullmatch(r"[a-z]{1,6}\.", text), text


def test_a_constrained_request_can_be_cancelled_midway(engine, tokenizer):
    sink = run(engine, tokenizer, "json", "", max_tokens=300, rid="cancel-me", streaming=True)
    while len(sink.chunks) < 3:
        sink.done.wait(0.01)
    engine.cancel("cancel-me")
    assert sink.done.wait(30)
    assert sink.chunks[-1].finish_reason == "cancelled"
    assert len(sink.tokens()) < 300


def test_a_small_max_tokens_ends_with_length(engine, tokenizer):
    guide = json.dumps(SCHEMAS["nested"])
    text, reason = answer(run(engine, tokenizer, "json_schema", guide, max_tokens=3), tokenizer)
    assert reason == "length"
    assert accepted_prefix("json_schema", guide, text, whole=False)


def test_without_an_end_id_the_answer_stops_where_the_grammar_ends(engine, tokenizer):
    sink = run(engine, tokenizer, "regex", r"(yes|no)\.", end_id=-1)
    text, reason = answer(sink, tokenizer)
    assert reason == "stop" and text in ("yes.", "no.")


def test_min_tokens_never_forces_text_past_a_complete_grammar(engine, tokenizer):
    sampling = SamplingParams(temperature=1.0, seed=1, min_tokens=20)
    sink = run(engine, tokenizer, "regex", r"(yes|no)\.", sampling=sampling)
    text, reason = answer(sink, tokenizer)
    assert reason == "stop" and text in ("yes.", "no.")
    assert sink.chunks[-1].num_output_tokens < 20


def test_log_probs_stay_the_models_own(engine, tokenizer):
    sink = run(engine, tokenizer, "regex", r"[a-z]{4}", return_log_probs=True)
    answer(sink, tokenizer)
    assert all(p <= 0 for c in sink.chunks for p in c.log_probs)
    ended = sink.chunks[-1].ended_by_end_id  # the end token's is logged too
    assert len([p for c in sink.chunks for p in c.log_probs]) == len(sink.tokens()) + ended


@pytest.mark.parametrize(
    ("guide_type", "guide", "message"),
    [
        ("json_schema", '{"type": "strin"}', "not a valid JSON Schema"),
        ("regex", "(ab", "not a valid regular expression"),
        ("xml", "", "not supported"),
    ],
)
def test_an_invalid_guide_is_refused_before_any_work(engine, tokenizer, guide_type, guide, message):
    with pytest.raises(InvalidRequest, match=message):
        run(engine, tokenizer, guide_type, guide)
    assert engine.num_queued == 0


def test_the_guide_tensors_reach_the_request():
    import numpy as np

    from tritonllm.engine.tensors import to_generation_request

    tensors = {
        "input_ids": np.array([[1, 2, 3]], dtype=np.int32),
        "request_output_len": np.array([[8]], dtype=np.int32),
        "guided_decoding_guide_type": np.array([[b"regex"]], dtype=object),
        "guided_decoding_guide": np.array([["[a-z]+ é".encode()]], dtype=object),
    }
    req = to_generation_request("r", tensors.get)
    assert (req.guide_type, req.guide) == ("regex", "[a-z]+ é")
    del tensors["guided_decoding_guide_type"]
    assert to_generation_request("r", tensors.get).guide_type is None
    tensors["guided_decoding_guide_type"] = np.array([[b""]], dtype=object)
    assert to_generation_request("r", tensors.get).guide_type is None


# Bounded repetitions compile into many states: seconds to compile, whatever the request
# (about 7 s on a 2-core machine; half as many, about 1 s).
def slow_regex(repetitions: int) -> str:
    return "".join(f"[a-{chr(ord('b') + i % 24)}]{{0,{50 + i}}}" for i in range(repetitions))


SLOW_REGEX = slow_regex(170)
LIMIT_S = 1.0


@pytest.fixture(scope="module")
def strict_engine(checkpoint_dir):
    """An engine whose guides must compile within LIMIT_S."""
    engine = Engine(
        CausalLMRunner(checkpoint_dir, dtype=DTYPE),
        max_batch_size=4,
        guide_compile_timeout_s=LIMIT_S,
    )
    yield engine
    engine.shutdown()


def test_a_slow_guide_compiles_off_the_loop_and_is_refused_at_the_limit(strict_engine, tokenizer):
    """The running batch keeps stepping and a plain request starts at once while a
    guide compiles; past the limit the guided request fails (a 400's words), and the
    same guide sent again is refused at once while its compile runs on."""
    engine = strict_engine
    running = run(
        engine, tokenizer, None, "", max_tokens=60, rid="running", end_id=-1, streaming=True
    )
    deadline = time.monotonic() + 30
    while not running.chunks and time.monotonic() < deadline:  # the batch is stepping
        time.sleep(0.01)
    started = time.perf_counter()
    slow = run(engine, tokenizer, "regex", SLOW_REGEX, rid="slow")
    assert time.perf_counter() - started < 0.5  # submit checks the guide, never compiles it
    plain = run(engine, tokenizer, None, "", max_tokens=4, rid="plain")
    assert plain.done.wait(LIMIT_S) and not plain.errors
    assert slow.done.wait(LIMIT_S + 2) and not slow.chunks
    assert "exceeds the limit of 1 s" in slow.errors[0] and "regex" in slow.errors[0]
    assert slow.codes == ["INVALID_ARG"] and slow.failed_at - started < LIMIT_S + 1
    assert running.done.wait(30) and not running.errors
    gaps = [b - a for a, b in zip(running.times, running.times[1:], strict=False)]
    assert max(gaps) < 0.3, f"the batch stalled {max(gaps):.2f} s while the guide compiled"
    with pytest.raises(InvalidRequest, match="exceeds the limit"):
        run(engine, tokenizer, "regex", SLOW_REGEX, rid="again")


def test_a_request_that_leaves_while_its_guide_compiles_is_cancelled(strict_engine, tokenizer):
    guide = slow_regex(100)  # a guide of its own, about a second to compile
    sink = run(strict_engine, tokenizer, "regex", guide, rid="leaves")
    strict_engine.cancel("leaves")
    assert sink.done.wait(1) and sink.chunks[-1].finish_reason == "cancelled" and not sink.errors
