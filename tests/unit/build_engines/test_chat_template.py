"""The default model's chat template (build_engines.default_model.CHAT_TEMPLATE) as
transformers' apply_chat_template renders it: plain messages, tools, tool calls and
tool responses, Hermes/Qwen style. Also the corpus's chats and JSON lines."""

from __future__ import annotations

import json

import pytest

from build_engines import corpus
from build_engines.default_model import BOS, CHAT_TEMPLATE, EOS, TOOLS_INSTRUCTION

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}


@pytest.fixture(scope="module")
def tok():
    """A tokenizer that carries the template (no vocabulary: rendering only)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()),
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
    )


def render(tok, messages, tools=None, add_generation_prompt=False) -> str:
    return tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def call(name: str, arguments, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


PLAIN = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Where is the cat?"},
    {"role": "assistant", "content": "The cat sees the red ball."},
    {"role": "user", "content": "Why?"},
]


@pytest.mark.parametrize("tools", [None, []])
def test_plain_messages_render_as_before(tok, tools):
    assert render(tok, PLAIN, tools, add_generation_prompt=True) == (
        "<s><|system|>\nAnswer briefly.</s>\n<|user|>\nWhere is the cat?</s>\n"
        "<|assistant|>\nThe cat sees the red ball.</s>\n<|user|>\nWhy?</s>\n<|assistant|>\n"
    )


def test_tools_are_listed_in_a_system_turn_one_json_line_each(tok):
    text = render(tok, [{"role": "user", "content": "Weather in Oslo?"}], [WEATHER, TIME], True)
    assert text == (
        "<s><|system|>\n<tools>\n"
        '{"name": "get_weather", "description": "Get the current weather in a city.", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
        '"required": ["city"]}}\n'
        '{"name": "get_time", "parameters": {"type": "object", "properties": {"city": '
        '{"type": "string"}}}}\n'
        f"</tools>\n{TOOLS_INSTRUCTION}</s>\n"
        "<|user|>\nWeather in Oslo?</s>\n<|assistant|>\n"
    )
    lines = text.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line)["name"] for line in lines] == ["get_weather", "get_time"]


def test_the_requests_system_message_leads_the_tools_turn(tok):
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    text = render(tok, messages, [WEATHER])
    assert text.startswith("<s><|system|>\nBe kind.\n<tools>\n")
    assert text.count("<|system|>") == 1 and text.endswith("<|user|>\nHi</s>\n")


def test_functions_given_without_the_openai_wrapper_are_listed_too(tok):
    text = render(tok, [{"role": "user", "content": "Hi"}], [WEATHER["function"]])
    assert '\n{"name": "get_weather", "description"' in text


CALLED = (
    '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call></s>\n"
)


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_tool_calls_render_with_string_or_dict_arguments(tok, arguments):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", arguments)]},
    ]
    assert render(tok, messages, [WEATHER]).endswith("<|user|>\nWeather in Paris?</s>\n" + CALLED)


def test_content_before_calls_and_several_calls(tok):
    calls = [call("get_weather", {"city": "Rome"}), call("get_time", '{"city": "Rome"}', "call_2")]
    messages = [{"role": "assistant", "content": "Let me see.", "tool_calls": calls}]
    assert render(tok, messages) == (
        "<s><|assistant|>\nLet me see.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call></s>\n'
    )


def test_consecutive_tool_responses_share_one_user_turn(tok):
    messages = [
        {"role": "user", "content": "Weather and time in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", "{}")]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"time": "9:05"}'},
        {"role": "assistant", "content": "Sunny, 9:05."},
    ]
    assert render(tok, messages, [WEATHER, TIME]).endswith(
        "</tool_call></s>\n<|user|>\n"
        '<tool_response>\n{"sky": "sunny"}\n</tool_response>\n'
        '<tool_response>\n{"time": "9:05"}\n</tool_response></s>\n'
        "<|assistant|>\nSunny, 9:05.</s>\n"
    )


def test_a_rendered_call_is_what_xgrammars_qwen_3_tag_constrains_a_call_to():
    xgr = pytest.importorskip("xgrammar")
    from transformers.utils.chat_template_utils import render_jinja_template

    tag = xgr.get_model_structural_tag(
        "qwen_3", tools=[WEATHER], tool_choice="required", reasoning=False
    )
    (item,) = tag.format.tags
    messages = [{"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"})]}]
    (text,), _ = render_jinja_template(
        [messages], chat_template=CHAT_TEMPLATE, bos_token=BOS, eos_token=EOS
    )
    assert text == f'{BOS}<|assistant|>\n{item.begin}{{"city": "Paris"}}{item.end}{EOS}\n'
    assert tag.format.triggers == ["<tool_call>"]


def test_the_corpus_is_deterministic_and_its_json_and_tool_calls_parse():
    docs = corpus.documents(600, seed=3)
    assert docs == corpus.documents(600, seed=3)
    lines = [d for d in docs if isinstance(d, str) and d.startswith("{")]
    chats = [d for d in docs if not isinstance(d, str)]
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)
    calls = [
        (m["tool_calls"][0]["function"], tools)
        for messages, tools in chats
        for m in messages
        if m.get("tool_calls")
    ]
    assert calls
    for function, tools in calls:
        assert function["name"] in {t["function"]["name"] for t in tools}
        assert isinstance(json.loads(function["arguments"]), dict)
        assert (
            json.dumps(json.loads(function["arguments"]), ensure_ascii=False)
            == function["arguments"]
        )
