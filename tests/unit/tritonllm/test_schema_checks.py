"""What a JSON guide may not hold: depth, external references, keywords the grammar does
not enforce; and that the list of those keywords is XGrammar's truth."""

from __future__ import annotations

import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from tritonllm.guided import InvalidGuide, grammar
from tritonllm.schema_checks import (
    MAX_DEPTH,
    UNENFORCED,
    external_refs,
    json_depth,
    unenforced_keywords,
)

# Each keyword of UNENFORCED in a schema, and an answer that violates it.
VIOLATED = {
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
    "not": ({"type": "integer", "not": {"const": 3}}, "3"),
    "if": ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 2}}, "3"),
    "then": ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 2}}, "3"),
    "else": ({"type": "integer", "if": {"maximum": -1}, "else": {"maximum": 2}}, "3"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]"),
    "minContains": (
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "minContains": 2},
        "[2, 2]",  # counted as items, not as items that match
    ),
    "maxContains": (
        {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "maxContains": 1},
        "[1, 1]",
    ),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": 1}',
    ),
    "dependentSchemas": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        '{"a": 1}',
    ),
}
# Keywords it does enforce, with a violating answer: the list must not grow to hold them.
ENFORCED = {
    "single allOf": ({"allOf": [{"type": "integer"}]}, '"a"'),
    "minimum": ({"type": "integer", "minimum": 5}, "3"),
    "pattern": ({"type": "string", "pattern": "^b+$"}, '"a"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    "propertyNames": (
        {"type": "object", "propertyNames": {"pattern": "^b$"}, "additionalProperties": True},
        '{"a": 1}',
    ),
}


def accepts(schema: dict, answer: str) -> bool:
    return _is_grammar_accept_string(
        xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), answer
    )


@pytest.mark.parametrize("keyword", UNENFORCED)
def test_each_unenforced_keyword_is_one_xgrammar_does_not_enforce(keyword):
    schema, violation = VIOLATED[keyword]
    assert accepts(schema, violation), f"XGrammar enforces {keyword} now: drop it from the list"
    assert any(p.endswith(f"/{keyword}") for p in unenforced_keywords(schema))


@pytest.mark.parametrize("name", ENFORCED)
def test_enforced_keywords_are_not_reported(name):
    schema, violation = ENFORCED[name]
    assert not accepts(schema, violation) and unenforced_keywords(schema) == []


def test_keywords_are_found_where_they_are_subschemas_only():
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "string"},  # a property named like a keyword
            "tags": {"type": "array", "items": {"anyOf": [{"type": "string", "not": {}}]}},
        },
        "$defs": {"if": {"type": "integer", "uniqueItems": True}},
        "enum": [{"not": 1}],  # data
        "default": {"allOf": []},
    }
    assert unenforced_keywords(schema) == [
        "/properties/tags/items/anyOf/0/not",
        "/$defs/if/uniqueItems",
    ]


def test_depth_counts_containers_not_brackets_in_strings():
    assert json_depth('{"a": [1, {"b": "[[[{{"}]}') == 3
    assert json_depth('"just a string"') == 0


def test_a_guide_past_the_depth_limit_is_refused_before_anything_recurses():
    deep = '{"items":' * 5000 + "{}" + "}" * 5000  # far past Python's stack
    with pytest.raises(InvalidGuide, match=f"nests 5001 levels .* limit of {MAX_DEPTH}"):
        grammar("json_schema", deep)
    at_limit = '{"items":' * (MAX_DEPTH - 1) + "{}" + "}" * (MAX_DEPTH - 1)
    grammar("json_schema", at_limit)


def test_external_references_are_found_and_refused():
    schema = {
        "$defs": {"local": {"type": "integer"}},
        "properties": {
            "a": {"$ref": "#/$defs/local"},
            "b": {"$ref": "file:///etc/passwd"},
            "$ref": {"type": "string"},  # a property named $ref
        },
    }
    assert external_refs(schema) == ["file:///etc/passwd"]
    with pytest.raises(InvalidGuide, match="outside it"):
        grammar("json_schema", json.dumps(schema))
    grammar("json_schema", json.dumps({**schema, "properties": {"a": {"$ref": "#/$defs/local"}}}))
