"""Every API's answer takes one path (serve/api/common/answer.py): the text cut at its
stop strings and split into content and tool calls the same way whole and streamed, in
chat completions, completions, the Responses API and the Messages API."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from serve.api.common.answer import Reading, answer_events, start_answer, whole_answer
from serve.api.common.tool_parsers import SYNTAXES
from serve.api.http import create_app
from serve.generation import GenerateParams
from tests.support.fakes import ScriptedBackend
from tests.support.payloads import ASK, CALL, CHAT_WEATHER, MESSAGES_WEATHER, RESPONSES_WEATHER


class ClosingBackend(ScriptedBackend):
    """Says which requests' engine streams were closed before their end, and which ran
    out by themselves."""

    def __init__(self, answer: str, piece: int = 3):
        super().__init__(answer, piece)
        self.closed: list[str] = []
        self.ran_out: list[str] = []

    async def _chunks(self, params):
        try:
            async for chunk in super()._chunks(params):
                yield chunk
        except GeneratorExit:
            self.closed.append(params.request_id)
            raise
        self.ran_out.append(params.request_id)


def http(backend) -> TestClient:
    return TestClient(create_app(backend), raise_server_exceptions=False)


def read(backend, reading: Reading) -> tuple:
    """(whole answer, streamed answer, the streamed content deltas joined)."""
    model = backend.config.model("llm")
    params = GenerateParams("p", 64, request_id="r", stop=reading.stops)

    async def both():
        whole = await whole_answer(backend, model, params, reading)
        stream = await start_answer(backend, model, params, reading)
        steps = [step async for step in stream]
        assert [s.finish_reason is not None for s in steps] == [False] * (len(steps) - 1) + [True]
        return whole, stream.answer, "".join(step.text for step in steps)

    return asyncio.run(both())


HERMES = SYNTAXES["hermes"]
CASES = [  # (the model's text, how it is read, content, calls' cities, the stop string found)
    ("one two STOP three", Reading(("STOP",)), "one two ", [], "STOP"),
    ("one two STOP three", Reading(("STOP",), keep_stop=True), "one two STOP", [], "STOP"),
    ("one ST two", Reading(("STOP",)), "one ST two", [], None),
    ("Let me look. " + CALL, Reading(syntax=HERMES), "Let me look. ", ["Paris"], None),
    ("Sure. " + CALL + " END no", Reading(("END",), HERMES), "Sure. ", ["Paris"], "END"),
    ("a b", Reading(echo="the prompt"), "the prompta b", [], None),
]


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 8, 64])
@pytest.mark.parametrize("text,reading,content,cities,found", CASES)
def test_whole_and_streamed_read_the_same_at_any_chunking(
    text, reading, content, cities, found, piece
):
    whole, streamed, deltas = read(ScriptedBackend(text, piece=piece), reading)
    for answer in (whole, streamed):
        assert answer.content == content and answer.stop_string == found
        assert [json.loads(c.arguments)["city"] for c in answer.calls] == cities
        assert answer.finish_reason == ("tool_calls" if cities else "stop")
    if not cities:
        assert deltas == content  # what the client saw as it streamed


def test_a_stop_string_ends_the_steps_and_stops_the_engine():
    backend = ClosingBackend("one two STOP three four five six", piece=3)
    model = backend.config.model("llm")

    async def steps_then_closed():
        params = GenerateParams("p", 64, request_id="r", stop=("STOP",))
        stream = await start_answer(backend, model, params, Reading(params.stop))
        steps = [step async for step in stream]
        return steps, stream, list(backend.closed)

    steps, stream, closed = asyncio.run(steps_then_closed())
    assert closed == ["r"]  # at the stop string, not at the end of the text
    assert steps[-1].chunk.num_output_tokens == 4  # "one", " tw", "o S", "TOP"
    assert stream.latest is steps[-1].chunk and stream.answer.stop_string == "STOP"


def test_events_close_the_engine_when_the_reader_leaves():
    backend = ClosingBackend("one two three four", piece=2)
    model = backend.config.model("llm")

    async def leave_after_the_first_event():
        params = GenerateParams("p", 64, request_id="r")
        events = answer_events(await start_answer(backend, model, params))
        assert (await events.__anext__()).text == "on"
        await events.aclose()
        return list(backend.closed)

    assert asyncio.run(leave_after_the_first_event()) == ["r"]


def test_the_same_text_is_the_same_answer_in_every_api():
    """Chat, Responses and Messages, whole and streamed through their SDKs, read one
    model text as the same content, the same call and the same stop."""
    text = "Let me look. " + CALL
    backend = ScriptedBackend(text, piece=4)
    chat_sdk = openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=http(backend), max_retries=0
    )
    messages_sdk = anthropic.Anthropic(
        base_url="http://testserver", api_key="x", http_client=http(backend), max_retries=0
    )
    chat = dict(model="llm", messages=ASK, tools=[CHAT_WEATHER], max_tokens=64)
    whole = chat_sdk.chat.completions.create(**chat).choices[0]
    calls = {}
    for chunk in chat_sdk.chat.completions.create(**chat, stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            calls[call.index] = calls.get(call.index, "") + (call.function.arguments or "")
    response = chat_sdk.responses.create(model="llm", input="weather?", tools=[RESPONSES_WEATHER])
    with chat_sdk.responses.stream(
        model="llm", input="weather?", tools=[RESPONSES_WEATHER]
    ) as events:
        streamed_response = events.get_final_response()
    message = dict(model="llm", max_tokens=64, messages=ASK, tools=[MESSAGES_WEATHER])
    created = messages_sdk.messages.create(**message)
    with messages_sdk.messages.stream(**message) as events:
        streamed_message = events.get_final_message()

    arguments = {"city": "Paris", "days": 2}
    assert whole.message.content == "Let me look. " and whole.finish_reason == "tool_calls"
    assert json.loads(whole.message.tool_calls[0].function.arguments) == arguments
    assert [json.loads(a) for a in calls.values()] == [arguments]
    for shaped in (response, streamed_response):
        said, call = shaped.output
        assert said.content[0].text == "Let me look. " and shaped.status == "completed"
        assert json.loads(call.arguments) == arguments
    for shaped in (created, streamed_message):
        said, call = shaped.content
        assert said.text == "Let me look. " and shaped.stop_reason == "tool_use"
        assert call.input == arguments


@pytest.mark.parametrize(
    "path,body,stop_field",
    [
        ("/v1/chat/completions", {"messages": ASK, "max_tokens": 8}, "stop"),
        ("/v1/completions", {"prompt": "p", "max_tokens": 8}, "stop"),
        ("/v1/responses", {"input": "weather?"}, None),  # the Responses API has no stops
        ("/v1/messages", {"messages": ASK, "max_tokens": 8}, "stop_sequences"),
    ],
)
def test_an_answer_the_engine_ended_lets_its_stream_end_by_itself(path, body, stop_field):
    """Closed before its end, the ingress's stream would cancel the replica's call: a
    round trip for every request, and a cancelled request in the replica's counts. A
    stop string found here closes it: the engine stops."""
    backend = ClosingBackend("one two", piece=2)
    body = {"model": "llm", "stream": True, **body}
    with http(backend).stream("POST", path, json=body) as response:
        assert response.status_code == 200 and '"tw' in response.read().decode()
    assert (len(backend.ran_out), backend.closed) == (1, [])
    if stop_field is not None:
        assert http(backend).post(path, json={**body, stop_field: ["tw"]}).status_code == 200
        assert (len(backend.ran_out), len(backend.closed)) == (1, 1)
