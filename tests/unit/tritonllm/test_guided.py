"""tritonllm.guided: guides checked without a tokenizer, compiled once per model."""

from __future__ import annotations

import json
import time

import pytest

from tritonllm.contract import GUIDE_TYPES
from tritonllm.guided import MAX_GUIDE_BYTES, GuideCompiler, InvalidGuide, grammar
from tritonllm.tokenization import InvalidRequest

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def tool_tag() -> str:
    import xgrammar as xgr

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    tag = xgr.get_model_structural_tag(
        "qwen_3", tools=tools, tool_choice="required", reasoning=False
    )
    return tag.model_dump_json()


def matches(guide_type: str, guide: str, text: str) -> bool:
    """Whether the guide's grammar accepts the whole of ``text`` (XGrammar's own test
    helper: no tokenizer)."""
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(grammar(guide_type, guide), text)


@pytest.mark.parametrize(
    ("guide_type", "guide", "good", "bad"),
    [
        ("json", "", '{"a": [1, 2]}', "{'a': 1}"),
        ("json_schema", json.dumps(SCHEMA), '{"name": "Ann", "age": 3}', '{"name": "Ann"}'),
        ("regex", r"[a-z]{3}-\d{2}", "abc-12", "abc-1"),
        ("ebnf_grammar", 'root ::= "yes" | "no"', "no", "maybe"),
        (
            "structural_tag",
            json.dumps(
                {
                    "structures": [
                        {"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"},
                    ],
                    "triggers": ["<f>"],
                }
            ),
            "text <f>12</f>",
            "text <f>x</f>",
        ),
    ],
)
def test_each_guide_type_compiles_to_its_grammar(guide_type, guide, good, bad):
    assert matches(guide_type, guide, good)
    assert not matches(guide_type, guide, bad)


def test_json_schema_output_uses_json_dumps_separators_only():
    guide = json.dumps(SCHEMA)
    assert matches("json_schema", guide, json.dumps({"name": "a", "age": 1}))
    assert not matches("json_schema", guide, '{"name":"a","age":1}')
    assert not matches("json_schema", guide, '{\n  "name": "a",\n  "age": 1\n}')


def test_a_model_structural_tag_constrains_tool_calls():
    tag = tool_tag()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert matches("structural_tag", tag, call)
    assert not matches("structural_tag", tag, call.replace("get_weather", "get_time"))


@pytest.mark.parametrize(
    ("guide_type", "guide", "message"),
    [
        ("json_schema", '{"type": ', r"json_schema guide is not valid JSON: Expecting value"),
        ("json_schema", '{"type": "strin"}', r"not a valid JSON Schema: 'strin' is not valid.*"),
        (
            "json_schema",
            '{"properties": {"a": {"minimum": "x"}}}',
            r"not a valid JSON Schema: 'x' is not of type 'number' \(at properties/a/minimum\)",
        ),
        ("json_schema", "[1]", r"must be a JSON object \(or a boolean\), got list"),
        ("json_schema", "", r"json_schema guide is empty"),
        ("regex", "(ab", r"regex guide is not a valid regular expression: .*parenthesis"),
        ("ebnf_grammar", 'root ::= "a" |', r"not a valid EBNF grammar.*Expect element"),
        ("ebnf_grammar", 'start ::= "a"', r"root rule with name \"root\" is not found"),
        ("structural_tag", "{", r"structural_tag guide is not valid JSON"),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', r"nope"),
        ("structural_tag", '{"structures": [{"begin": "<f>"}], "triggers": []}', r"'end'"),
        ("yaml", "a: 1", r"'yaml' is not supported; use one of json, json_schema, regex"),
    ],
)
def test_invalid_guides_name_the_type_and_the_cause(guide_type, guide, message):
    with pytest.raises(InvalidGuide, match=message) as caught:
        grammar(guide_type, guide)
    assert isinstance(caught.value, InvalidRequest)  # answered as a client error
    assert "/project/" not in str(caught.value) and ".cc:" not in str(caught.value)


def test_xgrammar_conversion_errors_are_invalid_guides():
    # A valid JSON Schema XGrammar cannot turn into a grammar (a reference it cannot follow).
    with pytest.raises(InvalidGuide, match=r"XGrammar cannot compile this json_schema guide"):
        grammar("json_schema", '{"$ref": "#/$defs/missing"}')


def test_a_guide_over_the_size_limit_is_refused():
    with pytest.raises(InvalidGuide, match=rf"exceeds the limit of {MAX_GUIDE_BYTES} bytes"):
        grammar("regex", "a" * (MAX_GUIDE_BYTES + 1))


def test_guide_types_are_upstreams():
    assert GUIDE_TYPES == ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")


def wide_schema(fields: int, salt: str = "") -> str:
    kinds = ({"type": "integer"}, {"type": "string"}, {"type": "boolean"}, {"enum": ["a", "b"]})
    properties = {f"field_{i}{salt}": kinds[i % len(kinds)] for i in range(fields)}
    return json.dumps({"type": "object", "properties": properties, "required": list(properties)})


def test_a_guide_compiles_once_then_comes_from_the_cache(checkpoint_dir):
    compiler = GuideCompiler.from_tokenizer_dir(checkpoint_dir, vocab_size=817)
    guide = wide_schema(20)
    start = time.perf_counter()
    compiler.compile("json_schema", guide)
    cold = time.perf_counter() - start
    size = compiler.cache_size_bytes
    start = time.perf_counter()
    compiler.compile("json_schema", guide)
    cached = time.perf_counter() - start
    print(f"20-field schema: cold {cold * 1e3:.2f} ms, cached {cached * 1e3:.2f} ms")
    assert size > 0 and compiler.cache_size_bytes == size  # nothing compiled again
    assert cached < cold / 10


def test_matchers_are_fresh_per_sequence_and_follow_the_end_id(checkpoint_dir, tokenizer):
    compiler = GuideCompiler.from_tokenizer_dir(checkpoint_dir, vocab_size=817)
    compiled = compiler.compile("ebnf_grammar", 'root ::= "yes"')
    first = compiler.matcher(compiled, end_id=2)
    assert first.accept_string("yes") and first.is_completed()
    assert not compiler.matcher(compiled, end_id=2).is_completed()
    assert compiler.matcher(compiled, end_id=5).stop_token_ids == [5]
    no_end = compiler.matcher(compiled, end_id=-1)
    assert no_end.accept_string("yes") and no_end.is_terminated()
