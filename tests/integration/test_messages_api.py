"""Anthropic's Messages API through the whole stack (the shipped Serve config on a real
cluster, real Triton, the default model), with the anthropic SDK: a message whole and
streamed, and a tool_use round trip forced by guided decoding."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

pytestmark = pytest.mark.integration
MODEL = "tritonllm-default"
WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city for some days",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "days", "unit"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
# The SDK no longer has a temperature argument (Anthropic's newest models take none);
# clients still send one, and the server takes it.
SAMPLED = {"extra_body": {"temperature": 1.0}}


@pytest.fixture(scope="module")
def url(one_replica_app):
    return one_replica_app


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


def test_a_message_has_real_token_counts(client):
    message = client.messages.create(
        model=MODEL, max_tokens=16, system="Answer briefly.", messages=ASK
    )
    assert message.id.startswith("msg_") and message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > len(ASK[0]["content"].split())
    assert 1 <= usage.output_tokens <= 16 and usage.cache_creation_input_tokens == 0
    (block,) = message.content
    assert block.type == "text" and block.text


def test_count_tokens_equals_the_input_tokens_the_message_reports(client):
    """The ingress counts with the engine's tokenizer and its preprocessing's special
    tokens: the count is what the engine read, cache hits included."""
    asked = {"model": MODEL, "system": "Answer briefly.", "messages": ASK, **FORCED}
    counted = client.messages.count_tokens(**asked)
    message = client.messages.create(**asked, max_tokens=40)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    plain = client.messages.count_tokens(model=MODEL, messages=ASK)
    assert plain.input_tokens < counted.input_tokens  # the tools are part of the prompt
    reply = client.messages.create(model=MODEL, messages=ASK, max_tokens=4)
    assert plain.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_a_streamed_message_is_its_deltas_joined(client):
    with client.messages.stream(model=MODEL, max_tokens=16, messages=ASK) as stream:
        deltas = list(stream.text_stream)
        message = stream.get_final_message()
    assert message.content[0].text == "".join(deltas) and len(deltas) > 1
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens >= 1 and message.usage.input_tokens > 0


def calls_of(message) -> list:
    calls = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and calls, message
    for call in calls:
        assert call.name == "get_weather" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, WEATHER["input_schema"])
    return calls


def test_a_forced_call_and_its_result_make_a_round_trip(client):
    first = client.messages.create(model=MODEL, max_tokens=120, messages=ASK, **FORCED, **SAMPLED)
    results = [
        {"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'}
        for call in calls_of(first)
    ]
    conversation = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": results},
    ]
    answer = client.messages.create(  # the model's context is 512 tokens
        model=MODEL,
        max_tokens=32,
        messages=conversation,
        tools=[WEATHER],
        tool_choice={"type": "none"},
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answer.content] == ["text"]


def test_a_forced_call_streamed_accumulates_its_input(client):
    with client.messages.stream(
        model=MODEL, max_tokens=120, messages=ASK, **FORCED, **SAMPLED
    ) as stream:
        message = stream.get_final_message()
    calls_of(message)
