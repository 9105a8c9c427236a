"""OpenAI's Responses API through the whole stack (the shipped Serve config on a real
cluster, real Triton, the default model) with the clients that speak it: the openai
SDK's ``responses.create`` and ``responses.stream``, and an OpenAI Agents SDK agent
with one tool. Stored responses: in the app's memory store, and in Redis, where they
outlive the ingress replica that stored them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import jsonschema
import openai
import pytest

from tests.integration.cluster import RedisServer, serve_config

pytestmark = pytest.mark.integration
MODEL = "tritonllm-default"
INGRESS = "OpenAIIngress"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
FORCED = {"type": "function", "name": "get_weather"}


def one_replica(built_repository, **args) -> dict:
    config = serve_config(
        built_repository, deployment={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}}
    )
    config["applications"][0]["args"] |= args
    return config


@pytest.fixture(scope="module")
def url(one_replica_app):
    return one_replica_app


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_create_and_stream_answer_text_with_real_usage(client):
    whole = client.responses.create(
        model=MODEL, input="Say hello.", max_output_tokens=40, temperature=0
    )
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 3 and 0 < whole.usage.output_tokens <= 40
    with client.responses.stream(
        model=MODEL, input="Say hello.", max_output_tokens=40, temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    # Greedy: the same answer streamed as whole, its deltas adding up to it.
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_log_probabilities_equal_chats_for_the_same_greedy_request(client):
    """The engine's own log probabilities, through the replica and the ingress, in the
    Responses API's shape: chat's entries token for token, whole and streamed."""
    asked = {"model": MODEL, "temperature": 0, "top_logprobs": 2}
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        logprobs=True,
        **asked,
    )
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert len(expected) >= 2 and all(len(e["top_logprobs"]) == 2 for e in expected)
    request = {**asked, "input": "Say hello.", "max_output_tokens": 12}
    request["include"] = ["message.output_text.logprobs"]
    whole = client.responses.create(**request)
    assert whole.output_text == chat.choices[0].message.content
    assert [e.model_dump() for e in whole.output[0].content[0].logprobs] == expected
    with client.responses.stream(**request) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert [e.model_dump() for d in deltas for e in d.logprobs] == expected
    assert [e.model_dump() for e in final.output[0].content[0].logprobs] == expected


def test_input_items_list_what_a_stored_response_was_sent(client):
    sent = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]
    response = client.responses.create(model=MODEL, input=sent, max_output_tokens=8)
    items = list(client.responses.input_items.list(response.id, order="asc"))
    assert [(item.type, item.role) for item in items] == [("message", s["role"]) for s in sent]
    assert [item.content[0].text for item in items] == [
        "My name is Ada.",
        "Hello Ada.",
        "What is my name?",
    ]
    assert len({item.id for item in items}) == 3
    newest = client.responses.input_items.list(response.id, limit=1)
    assert newest.data[0].id == items[-1].id and newest.has_more


def test_a_function_tool_round_trip_chained_by_previous_response_id(client):
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice=FORCED,
        temperature=1.0,
        max_output_tokens=100,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", first.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    assert client.responses.retrieve(first.id).output[-1].call_id == calls[0].call_id
    outputs = [
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
        for call in calls
    ]
    second = client.responses.create(
        model=MODEL,
        input=outputs,
        previous_response_id=first.id,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=60,
    )
    assert second.previous_response_id == first.id
    assert second.output[0].type == "message" and second.output_text
    # The chained turn's prompt held the first turn: longer than the new items alone.
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_forced_call_streams_as_function_call_events(client):
    with client.responses.stream(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice=FORCED,
        temperature=1.0,
        max_output_tokens=100,
    ) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert "".join(pieces) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_an_openai_agents_sdk_agent_runs_its_tool_against_the_stack(url):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # the SDK would export traces to OpenAI otherwise
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"Sunny and 21 C in {city}."

    sdk_client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=sdk_client),
        # Forced on the first turn (the SDK then resets it to auto, so the model answers).
        # Greedy, so every run is this one: sampled, the default model's answer sometimes
        # ran past max_tokens, an incomplete response the SDK raises as ModelBehaviorError.
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0.0, max_tokens=100),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=6))
    assert cities, "the agent never ran its tool"
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_missing_and_deleted_responses_are_404s(client):
    response = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=8)
    assert client.responses.delete(response.id) is None
    for call in (
        lambda: client.responses.retrieve(response.id),
        lambda: client.responses.delete(response.id),
        lambda: client.responses.create(
            model=MODEL, input="x", previous_response_id=response.id, max_output_tokens=8
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()


def test_responses_stored_in_redis_outlive_the_ingress_replica(cluster, built_repository):
    redis = RedisServer().start()
    try:
        store = {"store": "redis", "redis_url": f"redis://{redis.address}/0"}
        cluster.deploy(one_replica(built_repository, responses=store))
        cluster.wait_running()
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0)
        first = client.responses.create(model=MODEL, input="I am Ada.", max_output_tokens=16)
        (ingress,) = cluster.running_replicas("llm", INGRESS)
        os.kill(ingress["pid"], signal.SIGKILL)
        restarted = _wait_for_new_ingress(cluster, ingress["pid"])
        assert restarted["pid"] != ingress["pid"]
        stored = _retry_503(lambda: client.responses.retrieve(first.id))
        assert stored.output_text == first.output_text
        second = client.responses.create(
            model=MODEL, input="Who am I?", previous_response_id=first.id, max_output_tokens=16
        )
        assert second.usage.input_tokens > first.usage.input_tokens
    finally:
        cluster.deploy(one_replica(built_repository))  # the memory store again
        redis.stop()


def _wait_for_new_ingress(cluster, old_pid: int, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = [r for r in cluster.running_replicas("llm", INGRESS) if r["pid"] != old_pid]
        if running:
            return running[0]
        time.sleep(1)
    raise AssertionError(f"no new ingress replica within {timeout_s} s")


def _retry_503(call, timeout_s: float = 60):
    """Serve's proxy answers 503 until it routes to the new replica."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except (openai.InternalServerError, openai.APIConnectionError, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
