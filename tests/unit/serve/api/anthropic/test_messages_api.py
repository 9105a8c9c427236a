"""Anthropic's Messages API over the fake backends of the chat tests: the request's
conversion to a chat turn, the message whole and streamed as the anthropic SDK reads
them, stop reasons, Anthropic's error objects and its ``x-api-key`` header."""

from __future__ import annotations

import dataclasses
import json
import logging

import anthropic
import pytest
from fastapi.testclient import TestClient

from serve.api.anthropic.schemas import MessagesRequest
from serve.api.common.errors import Overloaded
from serve.api.common.keyring import Keyring
from serve.api.common.structured import NamedToolChoice
from serve.api.http import create_app
from tests.support.fakes import FakeBackend, ScriptedBackend
from tests.support.payloads import ASK, CALL
from tests.support.payloads import MESSAGES_WEATHER as WEATHER


def http(backend=None, keys=(), record=None) -> TestClient:
    app = create_app(backend or FakeBackend(), Keyring(keys), record)
    return TestClient(app, raise_server_exceptions=False)


def sdk(backend=None, keys=(), api_key: str = "unused") -> anthropic.Anthropic:
    """The anthropic SDK over the app (starlette's TestClient is an httpx.Client)."""
    return anthropic.Anthropic(
        base_url="http://testserver",
        api_key=api_key,
        http_client=http(backend, keys),
        max_retries=0,
    )


def post(api: TestClient, **body):
    return api.post("/v1/messages", json={"model": "llm", "max_tokens": 8, **body})


def anthropic_error(response, status: int, kind: str) -> str:
    """The message of an Anthropic error object, after checking its shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    return body["error"]["message"]


def events(api: TestClient, **body) -> list[dict]:
    """The SSE events of a streamed message, each ``event:`` line checked against its data."""
    response = post(api, stream=True, **body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    shaped = []
    for block in response.text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        shaped.append(event)
    return shaped


def comparable(message) -> dict:
    """A message as the SDK parsed it, without what differs between two requests (the
    ids) and the SDK's own empty fields."""
    dumped = message.model_dump(exclude={"id"}, exclude_none=True)
    for block in dumped["content"]:
        block.pop("id", None)
    if dumped["stop_reason"] == "stop_sequence":
        # The fake engine runs past a stop string: a stream is closed there, a whole
        # answer counts every token generated.
        del dumped["usage"]["output_tokens"]
    return dumped


def whole_and_streamed(client: anthropic.Anthropic, **body) -> tuple:
    """The same request created and streamed; the stream's accumulated message must be
    the created one."""
    created = client.messages.create(model="llm", **body)
    with client.messages.stream(model="llm", **body) as stream:
        streamed = stream.get_final_message()
    assert comparable(streamed) == comparable(created)
    return created, streamed


# -- the message -------------------------------------------------------------------------


def test_a_message_has_anthropics_shape_and_real_token_counts():
    message = post(http(), messages=[{"role": "user", "content": "a b c"}], max_tokens=2).json()
    assert message.pop("id").startswith("msg_")
    assert message == {
        "type": "message",
        "role": "assistant",
        "model": "llm",
        "content": [{"type": "text", "text": " a b"}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 3,
            "output_tokens": 2,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


@pytest.mark.parametrize(
    "backend, body, text, reason, sequence",
    [
        (FakeBackend(), {"max_tokens": 8}, " a b c d", "end_turn", None),
        (FakeBackend(), {"max_tokens": 2}, " a b", "max_tokens", None),
        (FakeBackend(), {"stop_sequences": ["x", "c"]}, " a b ", "stop_sequence", "c"),
        (
            # More than chat's 4 stop strings: the engines and the cutter take them all.
            FakeBackend(),
            {"stop_sequences": ["u", "v", "w", "x", "y", "z", "d"]},
            " a b c ",
            "stop_sequence",
            "d",
        ),
        (ScriptedBackend("It is sunny."), {}, "It is sunny.", "end_turn", None),
    ],
    ids=["end_turn", "max_tokens", "stop_sequence", "seven_stop_sequences", "scripted"],
)
def test_stop_reasons_whole_and_streamed(backend, body, text, reason, sequence):
    body = {"max_tokens": 8, **body}
    messages = [{"role": "user", "content": "a b c d"}]
    created, _ = whole_and_streamed(sdk(backend), messages=messages, **body)
    assert [block.text for block in created.content] == [text]
    assert (created.stop_reason, created.stop_sequence) == (reason, sequence)


def test_a_tool_call_is_a_tool_use_block_whole_and_streamed():
    backend = ScriptedBackend("Looking it up." + CALL)
    created, streamed = whole_and_streamed(
        sdk(backend), max_tokens=64, messages=ASK, tools=[WEATHER]
    )
    text, call = created.content
    assert text.text == "Looking it up." and created.stop_reason == "tool_use"
    assert (call.type, call.name, call.input) == (
        "tool_use",
        "get_weather",
        {"city": "Paris", "days": 2},
    )
    assert call.id.startswith("toolu_") and created.stop_sequence is None
    assert streamed.content[1].input == {"city": "Paris", "days": 2}  # from input_json_delta


def test_an_answer_of_calls_only_has_no_text_block():
    backend = ScriptedBackend("\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    created, _ = whole_and_streamed(sdk(backend), max_tokens=64, messages=ASK, tools=[WEATHER])
    assert [(b.type, b.input["city"]) for b in created.content] == [
        ("tool_use", "Paris"),
        ("tool_use", "Rome"),
    ]


def test_the_stream_opens_fills_and_closes_each_block_in_order():
    stream = events(http(ScriptedBackend("Sure." + CALL, piece=4)), messages=ASK, tools=[WEATHER])
    kinds = [(e["type"], e.get("index")) for e in stream if e["type"] != "content_block_delta"]
    assert kinds == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    start = stream[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    assert stream[2]["content_block"] == {"type": "text", "text": ""}
    tool_start = next(e for e in stream if e.get("index") == 1)
    assert tool_start["content_block"]["input"] == {}
    pieces = [e["delta"]["partial_json"] for e in stream if e.get("index") == 1 and "delta" in e]
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": 2}
    assert stream[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_usage_splits_the_prompt_into_cache_reads_and_the_rest():
    class CachedBackend(FakeBackend):
        async def _chunks(self, params):
            async for chunk in super()._chunks(params):
                yield dataclasses.replace(chunk, num_cached_tokens=2)

    created, _ = whole_and_streamed(
        sdk(CachedBackend()), max_tokens=8, messages=[{"role": "user", "content": "a b c"}]
    )
    usage = created.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (1, 2, 3)
    assert usage.cache_creation_input_tokens == 0
    # A stream tells the prompt's counts in message_start already, as Anthropic's does.
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "a b c"}]}
    start = events(http(CachedBackend()), **body)[0]["message"]["usage"]
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (1, 2)
    assert start["output_tokens"] == 0


# -- the request as a chat turn ----------------------------------------------------------


def test_system_tool_use_and_tool_results_reach_the_chat_template():
    backend = ScriptedBackend(CALL)
    client = sdk(backend)
    first = client.messages.create(model="llm", max_tokens=64, messages=ASK, tools=[WEATHER])
    (call,) = first.content
    system = [
        {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "be kind"},
    ]
    results = [
        {"type": "tool_result", "tool_use_id": call.id, "content": "20 degrees"},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_2",
            "content": [{"type": "text", "text": "dry"}],
        },
        {"type": "text", "text": "and tomorrow?"},
    ]
    second = {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}}
    conversation = [
        *ASK,
        # As the SDK sends its blocks back, and a second call of the same turn.
        {"role": "assistant", "content": [*first.content, second]},
        {"role": "user", "content": results},
    ]
    client.messages.create(
        model="llm", max_tokens=64, system=system, messages=conversation, tools=[WEATHER]
    )
    rendered, tools = backend.rendered[-1]
    arguments = {"city": "Paris", "days": 2}
    assert rendered == [
        {"role": "system", "content": "be brief\nbe kind"},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
            ],
        },
        {"role": "tool", "content": "20 degrees", "tool_call_id": call.id},
        {"role": "tool", "content": "dry", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    assert tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "the weather in a city",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]


def chat_of(**body):
    request = {"model": "llm", "max_tokens": 8, "messages": ASK, "tools": [WEATHER], **body}
    return MessagesRequest.model_validate(request).chat_request()


@pytest.mark.parametrize(
    "tool_choice, chat_choice, parallel",
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "none"}, "none", None),
        (
            {"type": "tool", "name": "get_weather"},
            NamedToolChoice(type="function", function={"name": "get_weather"}),
            None,
        ),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ],
)
def test_tool_choice_becomes_chats(tool_choice, chat_choice, parallel):
    chat = chat_of(tool_choice=tool_choice)
    assert (chat.tool_choice, chat.parallel_tool_calls) == (chat_choice, parallel)


def test_sampling_fields_and_metadata_carry_over():
    chat = chat_of(temperature=0.7, top_p=0.9, top_k=40, metadata={"user_id": "u1"})
    assert (chat.temperature, chat.top_p, chat.top_k, chat.user) == (0.7, 0.9, 40, "u1")
    assert (chat.max_tokens, chat.n, chat.stop) == (8, 1, [])


def test_what_clients_routinely_send_is_accepted():
    backend = ScriptedBackend("ok")
    response = post(
        http(backend),
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "hi",
                        "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    }
                ],
            }
        ],
        tools=[{**WEATHER, "cache_control": {"type": "ephemeral"}}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": False},
        metadata={"user_id": "session-1"},
        service_tier="auto",
        thinking={"type": "disabled"},
        temperature=1.0,
    )
    assert response.status_code == 200, response.text
    assert response.json()["content"] == [{"type": "text", "text": "ok"}]


def test_the_model_is_recorded_for_the_metrics():
    seen = []
    api = http(record=lambda scope, status, s: seen.append((scope, status)))
    post(api, messages=ASK)
    post(api, model="nope", messages=ASK)
    routes = [(scope["route"].path, scope["state"].get("model"), status) for scope, status in seen]
    assert routes == [("/v1/messages", "llm", 200), ("/v1/messages", None, 404)]


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, status, kind, words",
    [
        ({"messages": ASK, "n": 2}, 400, "invalid_request_error", "n: Extra inputs"),
        ({"messages": ASK, "model": "nope"}, 404, "not_found_error", "'nope' does not exist"),
        ({"messages": ASK, "max_tokens": 17}, 400, "invalid_request_error", "cap of 16"),
        ({"messages": ASK, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
                        ],
                    }
                ]
            },
            400,
            "invalid_request_error",
            "content block 1 has type 'image': only text",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "toolu_1",
                                "content": [{"type": "image", "source": {}}],
                            }
                        ],
                    }
                ]
            },
            400,
            "invalid_request_error",
            "block 0 has type 'image': a tool result's content is text only",
        ),
        (
            {"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}},
            400,
            "invalid_request_error",
            "thinking of type 'enabled' is not supported",
        ),
        (
            {"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "invalid_request_error",
            "tools.0: Value error, tool type 'web_search_20250305'",
        ),
        (
            {"messages": [*ASK, {"role": "assistant", "content": "It is"}]},
            400,
            "invalid_request_error",
            "prefill",
        ),
        (
            {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
            400,
            "invalid_request_error",
            "tool_choice",
        ),
        (
            {"messages": ASK, "tool_choice": {"type": "any"}},
            400,
            "invalid_request_error",
            "only allowed when tools are given",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    }
                ]
            },
            400,
            "invalid_request_error",
            "tool_use blocks are only allowed in assistant messages",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": "I will look."},
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}],
                    },
                ]
            },
            400,
            "invalid_request_error",
            "unexpected tool_use_id found in tool_result blocks: toolu_x",
        ),
    ],
    ids=[
        "openai_field",
        "unknown_model",
        "over_the_cap",
        "temperature_over_1",
        "image_block",
        "image_in_a_tool_result",
        "thinking",
        "server_tool",
        "prefill",
        "unknown_tool_named",
        "tool_choice_without_tools",
        "tool_use_from_the_user",
        "result_without_its_tool_use",
    ],
)
def test_bad_requests_are_anthropic_errors(body, status, kind, words):
    message = anthropic_error(post(http(), **body), status, kind)
    assert words in message


def test_a_request_without_max_tokens_names_it():
    response = http().post("/v1/messages", json={"model": "llm", "messages": ASK})
    assert "max_tokens: Field required" in anthropic_error(response, 400, "invalid_request_error")


def test_routing_and_size_errors_under_the_path_are_anthropics_and_others_stay_openais():
    api = http()
    anthropic_error(api.get("/v1/messages"), 405, "invalid_request_error")
    anthropic_error(api.post("/v1/messages/batches", json={}), 404, "not_found_error")
    big = json.dumps(
        {"model": "llm", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 5000}]}
    )
    response = api.post("/v1/messages", content=big, headers={"content-type": "application/json"})
    anthropic_error(response, 413, "request_too_large")
    assert set(api.get("/v1/nothing").json()) == {"error"}
    assert set(api.post("/v1/completions", content=big).json()["error"]) >= {"message", "param"}


def test_an_overloaded_backend_is_503_with_retry_after():
    api = http(FakeBackend(fail_after=0, error=Overloaded("busy")))
    response = post(api, messages=ASK, stream=True)
    assert anthropic_error(response, 503, "overloaded_error") == "busy"
    assert response.headers["retry-after"] == "1"


def test_an_unexpected_failure_is_an_api_error_without_details(caplog):
    api = http(FakeBackend(fail_after=0, error=RuntimeError("secret internals")))
    with caplog.at_level(logging.ERROR):
        message = anthropic_error(post(api, messages=ASK), 500, "api_error")
    assert "secret" not in message and "secret internals" in caplog.text


@pytest.mark.parametrize(
    "error, kind, message",
    [
        (Overloaded("replica lost"), "overloaded_error", "replica lost"),
        (
            RuntimeError("secret internals"),
            "api_error",
            "internal server error; see the server log",
        ),
    ],
)
def test_a_failure_mid_stream_is_an_error_event(error, kind, message, caplog):
    api = http(FakeBackend(fail_after=1, error=error))
    with caplog.at_level(logging.ERROR):
        stream = events(api, messages=[{"role": "user", "content": "a b c"}])
    assert [e["type"] for e in stream][:4] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
    ]
    assert stream[-1] == {"type": "error", "error": {"type": kind, "message": message}}
    with pytest.raises(anthropic.APIStatusError, match=message):
        with sdk(FakeBackend(fail_after=1, error=error)).messages.stream(
            model="llm", max_tokens=8, messages=[{"role": "user", "content": "a b c"}]
        ) as sdk_stream:
            sdk_stream.get_final_message()


# -- API keys ----------------------------------------------------------------------------


def test_the_key_comes_as_x_api_key_or_bearer():
    api = http(keys=frozenset({"k"}))
    body = {"model": "llm", "max_tokens": 2, "messages": ASK}
    missing = anthropic_error(api.post("/v1/messages", json=body), 401, "authentication_error")
    assert "x-api-key" in missing
    for headers in ({"x-api-key": "k9"}, {"Authorization": "Bearer k9"}):
        response = api.post("/v1/messages", json=body, headers=headers)
        assert anthropic_error(response, 401, "authentication_error") == "invalid API key"
    for headers in ({"x-api-key": "k"}, {"Authorization": "Bearer k"}):
        assert api.post("/v1/messages", json=body, headers=headers).status_code == 200
    assert sdk(keys=frozenset({"k"}), api_key="k").messages.create(**body).stop_reason
    with pytest.raises(anthropic.AuthenticationError):
        sdk(keys=frozenset({"k"}), api_key="k9").messages.create(**body)
    # OpenAI's routes keep their one header.
    assert api.get("/v1/models", headers={"x-api-key": "k"}).status_code == 401


def test_count_tokens_equals_the_input_tokens_of_the_same_message():
    """The anthropic SDK's ``count_tokens``: the system prompt, the messages and the
    tools the template renders, counted as the answer's usage counts them."""
    backend = FakeBackend()
    asked = {
        "model": "llm",
        "system": "be brief",
        "messages": [{"role": "user", "content": "one two three"}],
    }
    counted = sdk(backend).messages.count_tokens(**asked)
    message = sdk(backend).messages.create(**asked, max_tokens=16)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens == 5
    assert len(backend.params) == 1  # counting generates nothing


@pytest.mark.parametrize(
    "body, kind, words",
    [
        ({"model": "nope", "messages": ASK}, "not_found_error", "nope"),
        ({"model": "llm", "messages": []}, "invalid_request_error", "messages"),
        ({"model": "emb", "messages": ASK}, "not_found_error", "generate model 'emb'"),
    ],
)
def test_count_tokens_refuses_in_anthropics_shape(body, kind, words):
    response = http().post("/v1/messages/count_tokens", json=body)
    status = 404 if kind == "not_found_error" else 400
    assert words in anthropic_error(response, status, kind)


def test_count_tokens_wants_the_api_key():
    api = http(keys=frozenset({"k"}))
    body = {"model": "llm", "messages": ASK}
    assert api.post("/v1/messages/count_tokens", json=body).status_code == 401
    counted = api.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "k"})
    assert counted.status_code == 200 and counted.json() == {"input_tokens": 3}
