"""The tool-call parsers alone: every split of a stream reads as the whole answer does."""

from __future__ import annotations

import json

import pytest

from serve.api.common.tool_parsers import SYNTAXES, ToolCallParser, parse_whole

HERMES, LLAMA = SYNTAXES["hermes"], SYNTAXES["llama3_json"]
ARGUMENTS = {"city": 'Pa"ris }{', "days": [1, {"n": 2}], "ok": True, "none": None}


def hermes_call(name: str, arguments: dict) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


def streamed(syntax, text: str, piece: int):
    """Content, and each call's (name, arguments), from ``text`` fed ``piece`` at a time."""
    parser = ToolCallParser(syntax)
    content, calls = "", {}
    deltas = [parser.feed(text[i : i + piece]) for i in range(0, len(text), piece)]
    for delta in [*deltas, parser.finish()]:
        content += delta.content
        for index, _, name in delta.started:
            calls[index] = [name, ""]
        for index, piece_ in delta.arguments:
            calls[index][1] += piece_
    return content, [(name, json.loads(args)) for name, args in calls.values()]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 10_000])
def test_hermes_calls_split_anywhere_read_the_same(piece):
    text = "Let me check. " + hermes_call("get_weather", ARGUMENTS) + "\n" + hermes_call("b", {})
    content, calls = streamed(HERMES, text, piece)
    assert content == "Let me check. "
    assert calls == [("get_weather", ARGUMENTS), ("b", {})]
    whole_content, whole_calls = parse_whole(HERMES, text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls


def test_other_key_orders_and_spacing_still_parse():
    text = '<tool_call>{"arguments":{"q":"x"},"name":"search"}</tool_call>'
    content, calls = parse_whole(HERMES, text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("search", {"q": "x"})
    ]


@pytest.mark.parametrize("piece", [1, 4, 10_000])
def test_llama3_json_calls_with_python_tag_and_separators(piece):
    first = json.dumps({"name": "f", "parameters": {"a": 1}})
    second = json.dumps({"name": "g", "parameters": {}})
    content, calls = streamed(LLAMA, f"<|python_tag|>{first}; {second}", piece)
    assert content == "" and calls == [("f", {"a": 1}), ("g", {})]


@pytest.mark.parametrize(
    "syntax, text",
    [
        (HERMES, "no call, a <b>tag</b> and <tool_"),
        (HERMES, "<tool_call> something else </tool_call> and more"),
        (HERMES, '<tool_call>\n{"no_name": 1}\n</tool_call>'),
        (LLAMA, 'a set {1, 2} and {"name" without a call'),
    ],
)
@pytest.mark.parametrize("piece", [1, 10_000])
def test_text_that_is_not_a_call_is_all_content(syntax, text, piece):
    assert streamed(syntax, text, piece) == (text, [])
    assert parse_whole(syntax, text) == (text, [])


def test_a_call_cut_short_is_content_when_whole():
    text = hermes_call("f", {"a": "long text"})[:-20]
    assert parse_whole(HERMES, text) == (text, [])


def test_call_deltas_name_first_then_argument_pieces():
    parser = ToolCallParser(HERMES)
    opening = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a"')
    (started,) = opening.tool_call_deltas()
    assert started["index"] == 0 and started["id"].startswith("call_")
    assert started["function"]["name"] == "f" and started["type"] == "function"
    later = parser.feed(": 1}}\n</tool_call>").tool_call_deltas()
    assert later == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert parser.calls[0].arguments == '{"a": 1}'
