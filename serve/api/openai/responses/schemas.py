"""The request body of OpenAI's Responses API (``POST /v1/responses``) and its
conversion to the chat request every chat-shaped API generates from.

``extra="forbid"`` as everywhere: a field this server does not implement is a 400
naming it. What clients routinely send and what changes nothing here (``include`` of
output kinds this server never makes, ``prompt_cache_key``, ``service_tier``,
``safety_identifier``, ``reasoning`` without an effort) is accepted.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)

from serve.api.common import structured
from serve.api.common.structured import (
    FunctionDefinition,
    FunctionName,
    JSONObjectFormat,
    TextFormat,
)
from serve.api.common.unsupported import outsider
from serve.api.openai.fields import (
    MAX_TOP_LOG_PROBS,
    Text,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- input items -------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: Text


class OutputText(_Strict):
    """An answer's text, as a client sends a previous answer back."""

    type: Literal["output_text"]
    text: Text
    annotations: list | None = None
    logprobs: list | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def _text_parts_only(content):
    if found := outsider(content, ("input_text", "output_text", "refusal")):
        raise ValueError(
            f"content part {found[0]} has type {found[1]!r}: only text parts are supported "
            "(the model reads text only)"
        )
    return content


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart]
    id: str | None = None  # an output message sent back
    status: str | None = None
    phase: str | None = None

    _parts = field_validator("content", mode="before")(_text_parts_only)

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text  # JSON text, as the model wrote it
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


def _item_kind(item: Any) -> str | None:
    """Items without ``type`` are messages (the SDKs' ``{"role", "content"}``); None: not
    an item at all (a string, a number, null)."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


def _known_items(items):
    found = outsider(items, ("message", "function_call", "function_call_output"), _item_kind)
    if found is None:
        return items
    i, kind = found
    if kind is None and not isinstance(items[i], dict):
        raise ValueError(f"item {i} is a {type(items[i]).__name__}, not an item object")
    raise ValueError(
        f"item {i} has type {kind!r}: supported are message, function_call and function_call_output"
    )


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
]


# -- tools and formats -------------------------------------------------------------------


class FunctionTool(FunctionDefinition):
    """A function tool: chat's function definition with its ``type`` beside it."""

    type: Literal["function"]


class FunctionToolChoice(FunctionName):
    type: Literal["function"]


class JSONSchemaFormat(structured.JSONSchemaFormat):
    """Chat's ``json_schema`` format with its ``type`` beside it; a schema is required."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class TextConfig(_Strict):
    format: Annotated[
        TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
    ] = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: accepted


class Reasoning(_Strict):
    effort: None = None  # the models served here do not reason apart from their answer
    summary: None = None
    generate_summary: None = None


# Output kinds a client may ask to include: this server never makes any of them.
# What output text's ``logprobs`` holds only where the request includes it.
LOG_PROBS = "message.output_text.logprobs"
_INCLUDABLE = {
    LOG_PROBS,
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
}


class ResponsesRequest(_Strict):
    model: Text
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: dict[str, bool] | None = None  # include_obfuscation: nothing to hide
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[Text, Text] | None = Field(None, max_length=16)  # OpenAI's 16 pairs
    include: list[str] | None = None
    # Alternatives per token, with include: ["message.output_text.logprobs"].
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOG_PROBS)
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None  # the prefix cache needs no key
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop old items) is not done
    reasoning: Reasoning | None = None
    background: Literal[False] | None = None

    _items = field_validator("input", mode="before")(_known_items)

    @field_validator("metadata")
    @classmethod
    def _metadata_within_openais_bounds(cls, metadata):
        for key, value in (metadata or {}).items():
            if len(key) > 64:
                raise ValueError(f"key {key[:16]!r}... holds {len(key)} characters, more than 64")
            if len(value) > 512:
                raise ValueError(
                    f"the value of {key!r} holds {len(value)} characters, more than 512"
                )
        return metadata

    @field_validator("include")
    @classmethod
    def _includable(cls, include):
        for name in include or []:
            if name not in _INCLUDABLE:
                raise ValueError(f"{name!r} is not an output kind that can be included")
        return include

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = {tool.name for tool in self.tools or []}
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError("tool_choice is only allowed when tools are given")
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in names:
            raise ValueError(
                f"tool_choice names {self.tool_choice.name!r}, which is not one of the tools"
            )
        return self

    @property
    def wants_log_probs(self) -> bool:
        return LOG_PROBS in (self.include or ())

    @property
    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_request(self, conversation: list[dict]) -> dict:
        """The chat request of this turn: ``conversation`` (the items before it, stored
        with the previous response) and this request's items after the instructions."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [parse_item(item) for item in conversation] + self.items
        messages += chat_messages(items)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.wants_log_probs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs
        if self.tools:
            body["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = (
                choice
                if isinstance(choice, str)
                else {"type": "function", "function": {"name": choice.name}}
            )
        if self.text is not None:
            body["response_format"] = _response_format(self.text.format)
        return {k: v for k, v in body.items() if v is not None}


def parse_item(item: dict) -> MessageItem | FunctionCallItem | FunctionCallOutputItem:
    """A stored conversation's item (stored as validated: no error expected)."""
    return _ITEM.validate_python(item)


_ITEM = TypeAdapter(InputItem)


def chat_messages(items) -> list[dict]:
    """Items as chat messages: an assistant's text and the calls right after it are one
    assistant message; each call's output is a tool message."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def _chat_tool(tool: FunctionTool) -> dict:
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _response_format(text_format) -> dict:
    if isinstance(text_format, JSONSchemaFormat):
        schema = text_format.model_dump(exclude={"type"}, by_alias=True, exclude_none=True)
        return {"type": "json_schema", "json_schema": schema}
    return {"type": text_format.type}


def dump_items(items) -> list[dict]:
    return [json.loads(item.model_dump_json(by_alias=True, exclude_none=True)) for item in items]
