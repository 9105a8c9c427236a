"""OpenAI's Responses API at the HTTP layer, with the openai SDK itself as the client,
over a fake backend whose answer is scripted and a real memory store: the shapes whole
and streamed, function calls and their outputs, ``text.format``, stored responses and
``previous_response_id``, and the errors."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from fastapi.testclient import TestClient

from serve.api.common.errors import Overloaded
from serve.api.common.keyring import Keyring
from serve.api.http import create_app
from serve.api.openai.prepare import ChatTurn
from serve.api.openai.responses.draft import Draft
from serve.api.openai.responses.schemas import (
    LOG_PROBS,
    ResponsesRequest,
)
from serve.api.openai.responses.stream import response_events
from serve.generation import GenerateParams
from tests.support.fakes import FakeBackend, ScriptedBackend, StoringBackend, error_of
from tests.support.payloads import CALL, DEEP, SCHEMA
from tests.support.payloads import RESPONSES_WEATHER as WEATHER


def api(backend) -> TestClient:
    return TestClient(create_app(backend), raise_server_exceptions=False)


def sdk(backend) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=api(backend), max_retries=0
    )


def test_a_text_answer_whole_and_streamed_with_the_sdk():
    backend = StoringBackend("Paris is sunny.", piece=4)
    whole = sdk(backend).responses.create(model="llm", input="weather?", instructions="Be brief.")
    assert whole.status == "completed" and whole.output_text == "Paris is sunny."
    assert whole.id.startswith("resp_") and whole.model == "llm" and whole.store is True
    assert whole.usage.output_tokens == 4 and whole.usage.input_tokens == 1
    messages, tools = backend.rendered[0]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
    ]
    assert tools is None
    with sdk(backend).responses.stream(model="llm", input="weather?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Paris is sunny." and len(deltas) == 4
    assert final.output_text == "Paris is sunny." and final.status == "completed"
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_token_budget_cut_is_an_incomplete_response():
    backend = StoringBackend("a long answer", finish="length")
    response = sdk(backend).responses.create(model="llm", input="x", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert backend.params[0].max_tokens == 3
    body = (
        api(backend).post("/v1/responses", json={"model": "llm", "input": "x", "stream": True}).text
    )
    assert "event: response.incomplete" in body and "response.completed" not in body


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_a_function_call_round_trip(piece):
    backend = StoringBackend("Looking. " + CALL, piece=piece)
    client = sdk(backend)
    first = client.responses.create(model="llm", input="weather in Paris?", tools=[WEATHER])
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "Looking. "
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    # The client runs the tool and sends its output back with the conversation.
    backend.answer = "It is 21 C in Paris."
    turn = [
        {"role": "user", "content": "weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"},
    ]
    second = client.responses.create(model="llm", input=turn, tools=[WEATHER], store=False)
    assert second.output_text == "It is 21 C in Paris." and second.store is False
    messages, tools = backend.rendered[-1]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "Looking. "
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    assert messages[2] == {"role": "tool", "content": "21 C", "tool_call_id": call.call_id}
    assert tools[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("piece", [1, 2, 7, 1000])
def test_streamed_calls_become_function_call_items_whose_arguments_reassemble(piece):
    answer = "Looking. " + CALL + CALL.replace("Paris", "Rome")
    backend = StoringBackend(answer, piece=piece)
    with sdk(backend).responses.stream(model="llm", input="x", tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "function_call", "function_call"]
    calls = [item for item in final.output if item.type == "function_call"]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    streamed = {}
    for event in events:
        if event.type == "response.function_call_arguments.delta":
            streamed[event.item_id] = streamed.get(event.item_id, "") + event.delta
    assert streamed == {c.id: c.arguments for c in calls}
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in done] == [0, 1, 2]  # each item closed before the next
    assert final.output[0].content[0].text == "Looking. "


def test_tool_choice_and_text_format_become_the_engines_guides():
    backend = StoringBackend(CALL)
    client = sdk(backend)
    client.responses.create(
        model="llm",
        input="x",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert backend.params[-1].guide_type == "structural_tag"
    assert "get_weather" in backend.params[-1].guide
    backend.answer = '{"a": 1}'
    text = {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}}
    response = client.responses.create(model="llm", input="x", text=text)
    assert backend.params[-1].guide_type == "json_schema"
    assert json.loads(backend.params[-1].guide) == SCHEMA
    assert response.text.format.type == "json_schema" and response.output_text == '{"a": 1}'


def test_stored_responses_chain_and_can_be_read_and_deleted():
    backend = StoringBackend("Hi Ada.")
    client = sdk(backend)
    first = client.responses.create(model="llm", input="I am Ada.", instructions="Be kind.")
    backend.answer = "Your name is Ada."
    second = client.responses.create(
        model="llm", input="What is my name?", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    messages, _ = backend.rendered[-1]
    # The previous turn's input and output, then the new input; instructions are not
    # carried over (OpenAI's rule): only this request's.
    assert messages == [
        {"role": "user", "content": "I am Ada."},
        {"role": "assistant", "content": "Hi Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    assert client.responses.retrieve(second.id).output_text == "Your name is Ada."
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="llm", input="x", previous_response_id=first.id)
    assert missing.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="llm", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_streamed_response_is_stored_as_streamed():
    backend = StoringBackend("Looking. " + CALL, piece=2)
    client = sdk(backend)
    with client.responses.stream(model="llm", input="x", tools=[WEATHER]) as stream:
        final = stream.get_final_response()
    stored = client.responses.retrieve(final.id)
    assert stored.status == final.status == "completed" and stored.usage == final.usage
    assert [item.id for item in stored.output] == [item.id for item in final.output]
    assert stored.output[0].content[0].text == "Looking. "
    assert stored.output[1].arguments == final.output[1].arguments


def test_what_one_api_key_stores_no_other_key_reads_chains_from_or_deletes():
    backend = StoringBackend("Hi Ada.", piece=2)
    app = TestClient(create_app(backend, Keyring(["key-a", "key-b"])))

    def client(key: str) -> openai.OpenAI:
        url = "http://testserver/v1"
        return openai.OpenAI(base_url=url, api_key=key, http_client=app, max_retries=0)

    owner, other = client("key-a"), client("key-b")
    whole = owner.responses.create(model="llm", input="I am Ada.")
    with owner.responses.stream(model="llm", input="I am Ada.") as stream:
        streamed = stream.get_final_response()
    unknown = "resp_" + "0" * 32
    for response_id in (whole.id, streamed.id):
        # The same 404 as for an id never stored: nothing tells the other key it exists.
        for key_id in (response_id, unknown):
            with pytest.raises(openai.NotFoundError) as missing:
                other.responses.retrieve(key_id)
            assert missing.value.body["message"].replace(key_id, "ID") == (
                "no stored response with id 'ID' (never stored, deleted or expired)"
            )
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError) as missing:
            other.responses.create(model="llm", input="x", previous_response_id=response_id)
        assert missing.value.body["param"] == "previous_response_id"
        assert owner.responses.retrieve(response_id).output_text == "Hi Ada."
        owner.responses.create(model="llm", input="And?", previous_response_id=response_id)
    # The store holds neither key, only what names its owner without revealing the key.
    held = " ".join(backend.response_store._texts)
    assert "key-a" not in held and "key-b" not in held and whole.id in held
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(whole.id)
    assert [item.content[0].text for item in owner.responses.input_items.list(whole.id)] == [
        "I am Ada."
    ]
    owner.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        owner.responses.retrieve(whole.id)


def test_without_a_store_nothing_is_kept_and_chaining_is_a_400():
    backend = ScriptedBackend("hi")  # response_store None: the operator keeps none
    client = sdk(backend)
    response = client.responses.create(model="llm", input="x")
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="llm", input="x", previous_response_id=response.id)
    assert "keeps none" in refused.value.message


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "x", "tool_choice": "required"}, None),
        ({"input": "x", "include": ["message.output_text.log_probs"]}, "include"),
        ({"input": "x", "include": [LOG_PROBS], "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "max_output_tokens": 1000}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": [None]}, "input"),  # not an item
        (  # a guide past the nesting limit, named as this API names the field
            {
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": DEEP}},
            },
            "text.format.schema",
        ),
        (  # a result for a call the conversation never made
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "x"}]},
            "input",
        ),
        ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_bad_requests_are_400s_in_openais_shape(body, param):
    backend = StoringBackend()
    response = api(backend).post("/v1/responses", json={"model": "llm", **body})
    error = error_of(response, 400)
    if param is not None:
        assert error["param"].startswith(param), error
    if "call_x" in json.dumps(body):
        assert "'call_x' answers no call made earlier" in error["message"]
    bounds = {"model": "llm", "input": "x", "metadata": {"k" * 64: "v" * 512}}
    assert api(backend).post("/v1/responses", json=bounds).status_code == 200


def test_an_unknown_model_is_a_404_and_a_failure_mid_stream_fails_the_response():
    backend = StoringBackend()
    error = error_of(api(backend).post("/v1/responses", json={"model": "no", "input": "x"}), 404)
    assert error["param"] == "model"
    failing = StoringBackend("one two three four", piece=4)
    failing.fail_after, failing.error = 1, Overloaded("replica lost")

    async def chunks(params, inner=failing._chunks):
        async for i, chunk in _enumerate(inner(params)):
            if i >= 1:
                raise failing.error
            yield chunk

    failing._chunks = chunks
    body = (
        api(failing).post("/v1/responses", json={"model": "llm", "input": "x", "stream": True}).text
    )
    frames = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert frames[-1]["type"] == "response.failed"
    assert frames[-1]["response"]["error"]["message"] == "replica lost"
    assert failing.response_store._texts == {}  # a failed response is not stored


async def _enumerate(stream):
    i = 0
    async for item in stream:
        yield i, item
        i += 1


def test_a_stream_its_client_leaves_closes_the_engines_stream():
    # Starlette closes the response's generator when the client disconnects; the
    # engine's stream behind it must close too (the replica then cancels the sequence).
    closed = []

    class ClosingBackend(StoringBackend):
        async def _chunks(self, params):
            try:
                async for chunk in super()._chunks(params):
                    yield chunk
            finally:
                closed.append(params.request_id)

    async def leave_after_the_first_delta() -> list[str]:
        backend = ClosingBackend("one two three four", piece=2)
        turn = ChatTurn(backend.config.model("llm"), [GenerateParams("p", 8, request_id="r")], None)
        draft = Draft(ResponsesRequest(model="llm", input="x"), turn, stored=False)
        stream = await turn.start_answer(backend)
        frames = response_events(backend, draft, stream, [])
        async for frame in frames:
            if "response.output_text.delta" in frame:
                break
        await frames.aclose()
        return list(closed)  # now, not once asyncio.run has closed what is left

    assert asyncio.run(leave_after_the_first_delta()) == ["r"]


@pytest.mark.parametrize("stream", [False, True])
def test_metadata_with_a_lone_surrogate_is_a_400_not_a_cut_stream(stream):
    raw = b'{"model": "llm", "input": "x", "metadata": {"k": "\\ud800"}, "stream": %s}' % (
        b"true" if stream else b"false"
    )
    response = api(StoringBackend()).post(
        "/v1/responses", content=raw, headers={"content-type": "application/json"}
    )
    assert "surrogate" in error_of(response, 400)["message"]


@pytest.mark.parametrize("top", [0, 2])
def test_log_probabilities_equal_chats_whole_and_streamed(top):
    """Included, the output text's ``logprobs`` are chat's token entries for the same
    request (the end token last), whole, streamed (the deltas' together) and in the
    final response; the response echoes ``top_logprobs``."""
    backend = FakeBackend()
    chat = sdk(backend).chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": "a b c"}],
        logprobs=True,
        top_logprobs=top,
    )
    expected = [t.model_dump() for t in chat.choices[0].logprobs.content]
    assert [t["token"] for t in expected] == ["<0>", "<1>", "<2>", "</s>"]
    asked = {"model": "llm", "input": "a b c", "include": [LOG_PROBS], "top_logprobs": top}
    whole = sdk(backend).responses.create(**asked, store=False)
    assert whole.top_logprobs == top
    assert [t.model_dump() for t in whole.output[0].content[0].logprobs] == expected
    with sdk(backend).responses.stream(**asked, store=False) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [t.model_dump() for e in events if e.type.endswith("text.delta") for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == expected and [t.model_dump() for t in done.logprobs] == expected
    assert [t.model_dump() for t in final.output[0].content[0].logprobs] == expected
    plain = sdk(backend).responses.create(model="llm", input="a b c", store=False)
    assert plain.output[0].content[0].logprobs == [] and not backend.params[-1].return_log_probs


def test_alternatives_of_a_model_without_them_are_a_400_naming_top_logprobs():
    backend = FakeBackend()
    backend.alternatives = False  # TensorRT-LLM: the chosen tokens' log probabilities only
    asked = {"model": "llm", "input": "a", "include": [LOG_PROBS], "store": False}
    error = error_of(api(backend).post("/v1/responses", json={**asked, "top_logprobs": 2}), 400)
    assert error["param"] == "top_logprobs" and "TensorRT-LLM" in error["message"]
    chosen = api(backend).post("/v1/responses", json={**asked, "top_logprobs": 0}).json()
    assert [t["token"] for t in chosen["output"][0]["content"][0]["logprobs"]] == ["<0>", "</s>"]


SENT = [
    {"role": "user", "content": "weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"role": "user", "content": [{"type": "input_text", "text": "and tomorrow?"}]},
]


def test_input_items_list_what_the_response_was_sent_a_page_at_a_time():
    backend = StoringBackend("Sunny too.")
    client = sdk(backend)
    first = client.responses.create(model="llm", input=SENT, tools=[WEATHER])
    listed = client.responses.input_items.list(first.id, order="asc")
    items = [item.model_dump(exclude_none=True) for item in listed]
    assert [item["type"] for item in items] == [s.get("type", "message") for s in SENT]
    assert items[0]["content"] == [{"type": "input_text", "text": "weather in Paris?"}]
    assert items[3]["content"] == SENT[3]["content"] and items[0]["role"] == "user"
    assert (items[1]["call_id"], items[1]["name"], items[2]["output"]) == (
        "call_1",
        *"get_weather sunny".split(),
    )
    assert [item["id"].split("_")[0] for item in items] == ["msg", "fc", "fco", "msg"]
    assert all(item["status"] == "completed" for item in items)
    # OpenAI's default order is the last sent first; the SDK pages on after=last_id.
    newest_first = client.responses.input_items.list(first.id)
    assert [item.id for item in newest_first] == [item["id"] for item in items][::-1]
    one = client.responses.input_items.list(first.id, limit=1, order="asc")
    assert [item.id for item in one.data] == [items[0]["id"]] and one.has_more
    assert [item.id for item in one] == [item["id"] for item in items]  # every page
    # The ids stay the response's: a second listing gives the same.
    again = client.responses.input_items.list(first.id, order="asc")
    assert [item.id for item in again] == [item["id"] for item in items]
    # A chained response lists its own input only, not the conversation before it.
    second = client.responses.create(model="llm", input="thanks", previous_response_id=first.id)
    [only] = client.responses.input_items.list(second.id).data
    assert only.content[0].text == "thanks" and only.role == "user"


def test_input_items_of_an_unknown_response_or_after_an_unknown_item_are_errors():
    backend = StoringBackend("ok")
    client = sdk(backend)
    created = client.responses.create(model="llm", input="x")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_" + "0" * 32)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_items.list(created.id, after="msg_unknown")
    assert refused.value.body["param"] == "after"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(created.id, limit=101)
