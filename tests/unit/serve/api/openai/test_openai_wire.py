"""The exact JSON of OpenAI's responses and stream chunks, key for key: which keys are
null, which are left out, in which order. Clients parse these byte strings; a change of
the models in serve/api/openai/shapes.py that alters them must fail here first."""

from __future__ import annotations

import json
import re

from serve.api.common.sse import sse
from serve.api.openai.endpoints import (
    CHAT,
    COMPLETIONS,
    ChunkEvents,
)
from serve.api.openai.shapes import Usage
from serve.generation import GenerationChunk
from tests.support.fakes import ScriptedBackend, client, post
from tests.support.payloads import CALL, USER
from tests.support.payloads import CHAT_WEATHER as WEATHER

HEAD = {"id": "chatcmpl-ID", "created": 0, "model": "llm"}
CHUNK = '{"id":"chatcmpl-ID","created":0,"model":"llm","object":"chat.completion.chunk"'
USAGE = (
    '"usage":{"prompt_tokens":2,"completion_tokens":2,"total_tokens":4,'
    '"prompt_tokens_details":{"cached_tokens":0}}'
)


def masked(text: str) -> str:
    """Ids and times, which change with every request, as fixed stand-ins."""
    text = re.sub(r"(chatcmpl|cmpl)-[0-9a-f]{32}", r"\1-ID", text)
    text = re.sub(r"call_[0-9a-f]{24}", "call_ID", text)
    return re.sub(r'"created":\d+', '"created":0', text)


def events(text: str) -> list[str]:
    return [line for line in masked(text).splitlines() if line]


def chat(content: str, **extra) -> dict:
    return {"model": "llm", "messages": [{"role": "user", "content": content}], **extra}


def test_a_chat_stream_opens_with_the_role_and_leaves_out_what_a_chunk_lacks():
    body = chat("a b", stream=True, stream_options={"include_usage": True})
    choice = '"choices":[{"index":0,"delta":%s,"logprobs":null,"finish_reason":%s}]}'
    assert events(client().post("/v1/chat/completions", json=body).text) == [
        "data: " + CHUNK + "," + choice % ('{"role":"assistant","content":""}', "null"),
        "data: " + CHUNK + "," + choice % ('{"content":" a"}', "null"),
        "data: " + CHUNK + "," + choice % ('{"content":" b"}', "null"),
        "data: " + CHUNK + "," + choice % ("{}", '"stop"'),
        "data: " + CHUNK + ',"choices":[],' + USAGE + "}",
        "data: [DONE]",
    ]


def test_a_completion_stream_has_null_logprobs_and_reason_until_the_end():
    body = {
        "model": "llm",
        "prompt": "a b",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    head = 'data: {"id":"cmpl-ID","created":0,"model":"llm","object":"text_completion"'
    choice = ',"choices":[{"index":0,"text":%s,"logprobs":null,"finish_reason":%s}]}'
    assert events(client().post("/v1/completions", json=body).text) == [
        head + choice % ('" a"', "null"),
        head + choice % ('" b"', "null"),
        head + choice % ('""', '"stop"'),
        head + ',"choices":[],' + USAGE + "}",
        "data: [DONE]",
    ]


def test_streamed_tool_calls_name_the_call_first_then_send_argument_pieces():
    first = {"index": 0, "id": "call_ID", "type": "function"}
    first["function"] = {"name": "get_weather", "arguments": ""}
    piece = {"index": 0, "function": {"arguments": '{"ci'}}
    named = CHAT.chunk_choice(0, "Look. ", None, None, [first])
    assert sse(CHAT.chunk(HEAD, [named])) == (
        "data: " + CHUNK + ',"choices":[{"index":0,"delta":{"content":"Look. ","tool_calls":'
        '[{"index":0,"id":"call_ID","type":"function","function":{"name":"get_weather",'
        '"arguments":""}}]},"logprobs":null,"finish_reason":null}]}\n\n'
    )
    assert sse(CHAT.chunk(HEAD, [CHAT.chunk_choice(0, "", None, None, [piece])])) == (
        "data: " + CHUNK + ',"choices":[{"index":0,"delta":{"tool_calls":'
        '[{"index":0,"function":{"arguments":"{\\"ci"}}]},"logprobs":null,"finish_reason":null}]}'
        "\n\n"
    )


def test_continuous_usage_rides_on_every_chunk_that_asks_for_it():
    lasts = [GenerationChunk(" a", 2, 1, num_cached_tokens=1)]
    chunk = COMPLETIONS.chunk(HEAD, [COMPLETIONS.chunk_choice(0, " a", None)], Usage.of(lasts))
    assert sse(chunk).endswith(
        ',"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3,'
        '"prompt_tokens_details":{"cached_tokens":1}}}\n\n'
    )


def test_a_whole_chat_answer_with_logprobs():
    body = chat("a b", logprobs=True, top_logprobs=1)
    token = '{"token":"<%d>","logprob":%s,"bytes":[60,%d,62]'
    entries = [
        token % (i, p, 48 + i) + ',"top_logprobs":[' + token % (i, p, 48 + i) + "}]}"
        for i, p in ((0, "-0.0"), (1, "-1.0"))
    ]
    end = '{"token":"</s>","logprob":-9.0,"bytes":[60,47,115,62]'  # the end token: last
    entries.append(end + ',"top_logprobs":[' + end + "}]}")
    assert masked(client().post("/v1/chat/completions", json=body).text) == (
        '{"id":"chatcmpl-ID","created":0,"model":"llm","object":"chat.completion",'
        '"choices":[{"index":0,"message":{"role":"assistant","content":" a b"},'
        '"logprobs":{"content":[' + ",".join(entries) + '],"refusal":null},'
        '"finish_reason":"stop"}],' + USAGE + "}"
    )


def test_a_whole_completion_with_echoed_prompt_logprobs():
    body = {"model": "llm", "prompt": [50, 51], "logprobs": 1, "echo": True, "max_tokens": 1}
    assert masked(client().post("/v1/completions", json=body).text) == (
        '{"id":"cmpl-ID","created":0,"model":"llm","object":"text_completion",'
        '"choices":[{"index":0,"text":"<50><51> t50","logprobs":{"tokens":["<50>","<51>","<0>"],'
        '"token_logprobs":[null,-0.5,-0.0],"top_logprobs":[null,{"<51>":-0.5},{"<0>":-0.0}],'
        '"text_offset":[0,4,8]},"finish_reason":"length"}],'
        '"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3,'
        '"prompt_tokens_details":{"cached_tokens":0}}}'
    )


def test_a_whole_chat_answer_with_tool_calls():
    body = {"model": "llm", "messages": USER, "tools": [WEATHER]}
    call = (
        '{"id":"call_ID","type":"function","function":{"name":"get_weather",'
        '"arguments":"{\\"city\\": \\"Paris\\", \\"days\\": 2}"}}'
    )
    answer = masked(post(ScriptedBackend("Look. " + CALL), body).text)
    assert answer.startswith(
        '{"id":"chatcmpl-ID","created":0,"model":"llm","object":"chat.completion",'
        '"choices":[{"index":0,"message":{"role":"assistant","content":"Look. ",'
        '"tool_calls":[' + call + ']},"logprobs":null,"finish_reason":"tool_calls"}],"usage":'
    )
    only_calls = masked(post(ScriptedBackend(CALL), body).text)
    assert '"message":{"role":"assistant","content":null,"tool_calls":[' + call in only_calls


def test_a_streams_events_are_its_chunk_models_serialized():
    usage = Usage.of([GenerationChunk(" a", 2, 1)])
    logprobs = CHAT.logprobs(["<1>"], [-0.5], [[("<2>", -1.5)]], 0)
    piece = {"index": 0, "function": {"arguments": "{}"}}
    for endpoint, choices in [
        (CHAT, CHAT.openings(2)),
        (CHAT, [CHAT.chunk_choice(0, " a", None), CHAT.chunk_choice(1, "", "stop")]),
        (CHAT, [CHAT.chunk_choice(0, "é", "length", logprobs, [piece])]),
        (COMPLETIONS, [COMPLETIONS.chunk_choice(3, " a", None)]),
        (COMPLETIONS, []),
    ]:
        event = ChunkEvents(endpoint, HEAD)
        assert event(choices) == sse(endpoint.chunk(HEAD, choices))
        assert event(choices, usage) == sse(endpoint.chunk(HEAD, choices, usage))


def test_an_event_stays_one_line_for_readers_that_split_on_unicode_line_breaks():
    # httpx's aiter_lines splits like str.splitlines: also at U+0085, U+2028, U+2029,
    # which a model may write and JSON leaves raw (a reader then parsed half an event).
    text = "a\u2028b\x85c\u2029é"
    events = [
        ChunkEvents(CHAT, HEAD)([CHAT.chunk_choice(0, text, None)]),
        sse(COMPLETIONS.chunk(HEAD, [COMPLETIONS.chunk_choice(0, text, None)])),
    ]
    for event in events:
        line, blank = event.splitlines()
        assert blank == "" and line.startswith("data: ")
        choice = json.loads(line.removeprefix("data: "))["choices"][0]
        assert choice.get("text", choice.get("delta", {}).get("content")) == text
