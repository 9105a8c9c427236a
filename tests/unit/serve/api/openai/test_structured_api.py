"""Structured outputs and tool calls at the HTTP layer, over a fake backend whose answer
is scripted: what each request field becomes as a guide for the engine, the 400s of bad
guides and tools, and tool calls read out of the answer, whole and streamed."""

from __future__ import annotations

import json

import pytest
import xgrammar

from tests.support.fakes import ScriptedBackend, error_of, post
from tests.support.payloads import CALL, DEEP, SCHEMA, USER
from tests.support.payloads import CHAT_WEATHER as WEATHER

CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
# Keywords the grammar does not enforce (tritonllm/schema_checks.py): a 400 with strict.
UNENFORCED = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "n": {"type": "integer", "not": {"const": 3}},
    },
}
STRICT_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": UNENFORCED, "strict": True},
}


def chat(backend, **body):
    return post(backend, {"model": "llm", "messages": USER, **body})


def streamed(backend, **body) -> list[dict]:
    response = chat(backend, stream=True, **body)
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- guides ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, guide_type, guide",
    [
        ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            "json_schema",
            json.dumps(SCHEMA),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "ebnf_grammar", 'root ::= "a"'),
        (
            {"structured_outputs": {"choice": ["yes", 'n"o']}},
            "ebnf_grammar",
            'root ::= "yes" | "n\\"o"',
        ),
        ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
        ({"guided_regex": "a|b"}, "regex", "a|b"),
        ({"guided_choice": ["x"]}, "ebnf_grammar", 'root ::= "x"'),
        ({"response_format": {"type": "text"}}, None, ""),
    ],
)
def test_each_structured_output_field_becomes_one_guide(body, guide_type, guide):
    backend = ScriptedBackend()
    assert chat(backend, **body).status_code == 200
    assert (backend.params[0].guide_type, backend.params[0].guide) == (guide_type, guide)
    completion = {"model": "llm", "prompt": "x", **body}
    assert post(backend, completion, "/v1/completions").status_code == 200
    assert backend.params[1].guide_type == guide_type


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format.json_schema.schema",
            "JSON Schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar", ""),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format, guided_regex",
            "not several",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools.0.function.name",
            "",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools.0.function.parameters",
            "JSON Schema",
        ),
        ({"tools": []}, "tools", ""),
        (  # a forced call and a format: one of them could not hold
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "tool_choice",
            "guided_regex cannot be combined with a forced tool call",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": UNENFORCED, "strict": True},
                }
            },
            "response_format.json_schema.schema",
            "does not enforce /properties/tags/uniqueItems, /properties/n/not",
        ),
        (
            {"tools": [STRICT_TOOL]},
            "tools.0.function.parameters",
            "does not enforce /properties/tags/uniqueItems",
        ),
        (
            {"guided_json": {"$ref": "https://example.com/schema.json"}},
            "guided_json",
            "refers to a schema outside it ($ref 'https://example.com/schema.json')",
        ),
        ({"guided_json": DEEP}, "guided_json", "nests 101 levels of arrays and objects"),
    ],
)
def test_a_bad_guide_or_tool_is_a_400_naming_the_field(body, param, words):
    backend = ScriptedBackend()
    error = error_of(chat(backend, **body), 400)
    assert error["param"] == param and words in error["message"], error
    assert chat(backend).status_code == 200  # and the app serves on
    assert all(p.guide_type is None for p in backend.params)


def test_tools_need_a_parser_configured_for_the_model():
    body = {"model": "plain", "messages": USER, "tools": [WEATHER]}
    error = error_of(post(ScriptedBackend(), body), 400)
    assert error["param"] == "tools" and "tool_call_parser" in error["message"]
    # tool_choice none: the answer is not read for calls, so no parser is needed
    assert post(ScriptedBackend(), body | {"tool_choice": "none"}).status_code == 200


@pytest.mark.parametrize(
    "choice, parallel",
    [
        ("auto", True),
        ("required", True),
        ("required", False),
        ({"type": "function", "function": {"name": "get_weather"}}, True),
    ],
)
def test_tool_choice_is_xgrammars_structural_tag_for_the_models_syntax(choice, parallel):
    backend = ScriptedBackend(CALL)
    chat(backend, tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=parallel)
    params = backend.params[0]
    expected = xgrammar.get_model_structural_tag(
        "qwen_3",
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
        reasoning=False,
        parallel_tool_calls=parallel,
        max_whitespace_cnt=1,
    )
    assert params.guide_type == "structural_tag"
    assert json.loads(params.guide) == json.loads(expected.model_dump_json())
    messages, tools = backend.rendered[0]
    assert tools == [WEATHER, CLOCK] and messages == USER


def test_tool_choice_none_renders_the_tools_but_leaves_the_answer_free():
    backend = ScriptedBackend(CALL)
    message = chat(backend, tools=[WEATHER], tool_choice="none").json()["choices"][0]["message"]
    assert backend.params[0].guide_type is None and backend.rendered[0][1] == [WEATHER]
    assert message == {"role": "assistant", "content": CALL}


def test_without_strict_a_schema_with_unenforced_keywords_is_served():
    """They are listed in docs/structured-outputs.md; only strict refuses them."""
    loose = {"type": "json_schema", "json_schema": {"name": "x", "schema": UNENFORCED}}
    backend = ScriptedBackend()
    assert chat(backend, response_format=loose).status_code == 200
    tool = {"type": "function", "function": {"name": "f", "parameters": UNENFORCED}}
    assert chat(backend, tools=[tool]).status_code == 200
    assert [p.guide_type for p in backend.params] == ["json_schema", "structural_tag"]


def test_with_tool_choice_auto_a_response_format_wins():
    answer = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    backend = ScriptedBackend(f"<tool_call>{answer}</tool_call>")
    body = {"tools": [WEATHER], "response_format": {"type": "json_object"}}
    message = chat(backend, **body).json()["choices"][0]["message"]
    assert backend.params[0].guide_type == "json_schema"
    assert "tool_calls" not in message  # the answer is the format, never read for calls


# -- calls in the answer ---------------------------------------------------------------


def test_a_call_in_the_answer_is_a_tool_call_with_finish_reason_tool_calls():
    response = chat(ScriptedBackend("Let me look. " + CALL), tools=[WEATHER]).json()
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look. "
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_only_calls_leave_content_null_and_several_calls_keep_their_order():
    second = CALL.replace("Paris", "Oslo")
    choice = chat(ScriptedBackend(CALL + "\n" + second), tools=[WEATHER]).json()["choices"][0]
    assert choice["message"]["content"] is None
    cities = [
        json.loads(c["function"]["arguments"])["city"] for c in choice["message"]["tool_calls"]
    ]
    assert cities == ["Paris", "Oslo"]


@pytest.mark.parametrize(
    "answer",
    [
        "<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut short
        "a plain answer with a < sign and <tool_ but no call",
    ],
)
def test_text_that_does_not_parse_as_a_call_is_plain_content(answer):
    response = chat(ScriptedBackend(answer), tools=[WEATHER])
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": answer}
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_streamed_calls_come_as_openai_fragments_that_reassemble(piece):
    answer = "Looking. " + CALL + CALL.replace("Paris", "Rome")
    chunks = streamed(ScriptedBackend(answer, piece=piece), tools=[WEATHER])
    content, calls, finish = "", {}, None
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for fragment in delta.get("tool_calls", []):
            if "id" in fragment:  # the first fragment of a call: id, type and name
                assert fragment["index"] not in calls and fragment["type"] == "function"
                calls[fragment["index"]] = {
                    "id": fragment["id"],
                    "name": fragment["function"]["name"],
                    "arguments": "",
                }
            calls[fragment["index"]]["arguments"] += fragment["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    assert content == "Looking. " and finish == "tool_calls"
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == ["Paris", "Rome"]
    assert all(c["name"] == "get_weather" and c["id"].startswith("call_") for c in calls.values())


def test_a_streamed_answer_without_calls_is_all_content():
    answer = "It is sunny <b>today</b>, no <tool_ call."
    chunks = streamed(ScriptedBackend(answer, piece=2), tools=[WEATHER])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == answer and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_length_cut_keeps_finish_reason_length():
    cut = CALL[:50]
    choice = chat(ScriptedBackend(cut, finish="length"), tools=[WEATHER]).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == cut


# -- the conversation ------------------------------------------------------------------


def test_assistant_calls_and_tool_results_reach_the_chat_template():
    backend = ScriptedBackend("It is 20 degrees.")
    arguments = '{"city": "Paris"}'
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "20 degrees"},
    ]
    response = post(backend, {"model": "llm", "messages": messages, "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    rendered, _ = backend.rendered[0]
    assert rendered[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert rendered[2] == {"role": "tool", "content": "20 degrees", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "tool", "content": "x"}, "messages.1"),  # no tool_call_id
        ({"role": "user", "content": "x", "tool_calls": []}, "messages.1"),
        ({"role": "assistant"}, "messages.1"),  # neither content nor calls
        # A result for a call no earlier assistant message made.
        ({"role": "tool", "tool_call_id": "call_x", "content": "20"}, "messages"),
    ],
)
def test_malformed_tool_messages_are_400s(message, param):
    body = {"model": "llm", "messages": [*USER, message]}
    assert error_of(post(ScriptedBackend(), body), 400)["param"] == param


def test_a_guided_requests_preparation_runs_off_the_event_loop():
    """Checking a new guide takes milliseconds or more: the loop relaying the other
    streams keeps going meanwhile; a request without a guide is prepared inline."""
    import asyncio
    import time

    from serve.api.openai.prepare import guided
    from serve.api.openai.schemas import ChatCompletionRequest

    async def ticks_while(body) -> int:
        count = 0

        async def tick():
            nonlocal count
            while True:
                count += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        assert await guided(lambda: time.sleep(0.3) or "prepared", body) == "prepared"
        ticker.cancel()
        return count

    plain = ChatCompletionRequest(model="llm", messages=USER)
    assert not plain.has_guide and asyncio.run(ticks_while(plain)) <= 2
    for body in ({"guided_regex": "a"}, {"tools": [WEATHER]}):
        request = ChatCompletionRequest(model="llm", messages=USER, **body)
        assert request.has_guide and asyncio.run(ticks_while(request)) >= 10
    unused = ChatCompletionRequest(model="llm", messages=USER, tools=[WEATHER], tool_choice="none")
    assert not unused.has_guide
