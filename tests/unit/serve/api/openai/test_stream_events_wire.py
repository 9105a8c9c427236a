"""The exact JSON of the stream events of Anthropic's Messages API and OpenAI's Responses
API, key for key, as tests/unit/serve/api/openai/test_openai_wire.py pins chat's: which
keys are null, which are left out, in which order. Their models (serve/api/anthropic/shapes.py,
serve/api/openai/responses/shapes.py) must not change these bytes unnoticed."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from serve.api.http import create_app
from tests.support.fakes import ScriptedBackend, StoringBackend
from tests.support.payloads import ASK, CALL
from tests.support.payloads import MESSAGES_WEATHER as TOOL
from tests.support.payloads import RESPONSES_WEATHER as WEATHER

ARGUMENTS = r'"{\"city\": \"Paris\", \"days\": 2}"'


def masked(text: str) -> str:
    """Ids and times, which change with every request, as fixed stand-ins."""
    for pattern, stand_in in [
        (r"(msg|resp|fc)_[0-9a-f]{32}", r"\1_ID"),
        (r"(call|toolu)_[0-9a-f]{24}", r"\1_ID"),
        (r'"(created_at|completed_at)":\d+', r'"\1":0'),
    ]:
        text = re.sub(pattern, stand_in, text)
    return text


def frames(backend, path: str, **body) -> list[str]:
    """Each SSE event of a streamed answer, ``event:`` line and ``data:`` line."""
    app = create_app(backend)
    response = TestClient(app).post(path, json={"model": "llm", "stream": True, **body})
    assert response.status_code == 200, response.text
    return masked(response.text).removesuffix("\n\n").split("\n\n")


def of_type(events: list[str], kind: str) -> list[str]:
    return [event for event in events if event.startswith(f"event: {kind}\n")]


# -- Anthropic's Messages API ------------------------------------------------------------


def message_events() -> list[str]:
    backend = ScriptedBackend("Sure." + CALL, piece=5)
    return frames(backend, "/v1/messages", max_tokens=64, messages=ASK, tools=[TOOL])


def test_a_messages_stream_opens_with_the_empty_message_and_a_ping():
    assert message_events()[:2] == [
        'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_ID",'
        '"type":"message","role":"assistant","model":"llm","content":[],"stop_reason":null,'
        '"stop_sequence":null,"usage":{"input_tokens":1,"output_tokens":0,'
        '"cache_creation_input_tokens":0,"cache_read_input_tokens":0}}}',
        'event: ping\ndata: {"type":"ping"}',
    ]


def test_a_text_delta_and_a_tool_use_block_with_its_input_json():
    events = message_events()
    assert of_type(events, "content_block_start") == [
        'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        '"content_block":{"type":"text","text":""}}',
        'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
        '"content_block":{"type":"tool_use","id":"toolu_ID","name":"get_weather","input":{}}}',
    ]
    deltas = of_type(events, "content_block_delta")
    assert deltas[0] == (
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"Sure."}}'
    )
    assert deltas[-1].startswith(
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        '"delta":{"type":"input_json_delta","partial_json":'
    )
    assert of_type(events, "content_block_stop")[-1] == (
        'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}'
    )


def test_a_messages_stream_ends_with_the_stop_reason_and_the_whole_usage():
    assert message_events()[-2:] == [
        'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use",'
        '"stop_sequence":null},"usage":{"input_tokens":1,"output_tokens":20,'
        '"cache_creation_input_tokens":0,"cache_read_input_tokens":0}}',
        'event: message_stop\ndata: {"type":"message_stop"}',
    ]


# -- OpenAI's Responses API --------------------------------------------------------------


def response_events(answer: str, **body) -> list[str]:
    return frames(StoringBackend(answer, piece=9), "/v1/responses", input="x", **body)


def test_a_text_delta_names_its_item_and_part():
    delta = of_type(response_events("Paris is sunny."), "response.output_text.delta")[0]
    assert delta == (
        'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        '"sequence_number":4,"item_id":"msg_ID","output_index":0,"content_index":0,'
        '"delta":"Paris is ","logprobs":[]}'
    )


def test_a_function_call_opens_empty_and_closes_with_its_arguments():
    events = response_events(CALL, tools=[WEATHER])
    assert of_type(events, "response.output_item.added") == [
        'event: response.output_item.added\ndata: {"type":"response.output_item.added",'
        '"sequence_number":2,"output_index":0,"item":{"id":"fc_ID","type":"function_call",'
        '"status":"in_progress","call_id":"call_ID","name":"get_weather","arguments":""}}'
    ]
    assert of_type(events, "response.function_call_arguments.done") == [
        "event: response.function_call_arguments.done\ndata: "
        '{"type":"response.function_call_arguments.done","sequence_number":7,'
        '"item_id":"fc_ID","output_index":0,"name":"get_weather","arguments":' + ARGUMENTS + "}"
    ]


RESPONSE = (
    '{"id":"resp_ID","object":"response","created_at":0,"status":"%s","background":false,'
    '"error":null,"incomplete_details":null,"instructions":"Be brief.",'
    '"max_output_tokens":null,"metadata":{"k":"v"},"model":"llm","output":%s,'
    '"parallel_tool_calls":true,"previous_response_id":null,'
    '"reasoning":{"effort":null,"summary":null},"store":true,"temperature":null,'
    '"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],"top_p":null,'
    '"top_logprobs":null,'
    '"truncation":"disabled","usage":%s,"user":null%s}'
)


def test_the_response_is_in_progress_first_and_completed_last():
    events = response_events("Paris.", instructions="Be brief.", metadata={"k": "v"})
    assert events[0] == (
        'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
        '"response":' + RESPONSE % ("in_progress", "[]", "null", "") + "}"
    )
    item = (
        '[{"id":"msg_ID","type":"message","status":"completed","role":"assistant",'
        '"content":[{"type":"output_text","text":"Paris.","annotations":[],"logprobs":[]}]}]'
    )
    usage = (
        '{"input_tokens":1,"input_tokens_details":{"cached_tokens":0},"output_tokens":1,'
        '"output_tokens_details":{"reasoning_tokens":0},"total_tokens":2}'
    )
    assert events[-1] == (
        'event: response.completed\ndata: {"type":"response.completed","sequence_number":8,'
        '"response":' + RESPONSE % ("completed", item, usage, ',"completed_at":0') + "}"
    )


def test_an_event_stays_one_line_for_readers_that_split_on_unicode_line_breaks():
    text = "a\u2028b\x85c\u2029é"  # JSON leaves these raw; json.dumps escaped them
    for events in (
        frames(ScriptedBackend(text, piece=99), "/v1/messages", max_tokens=8, messages=ASK),
        response_events(text),
    ):
        assert all(len(event.splitlines()) == 2 for event in events)
        assert "é" in "".join(events)
