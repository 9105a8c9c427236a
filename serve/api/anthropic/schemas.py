"""Anthropic's Messages API (``POST /v1/messages``): the request as this server accepts
it, and its conversion to the chat request every chat-shaped API generates from (the
message it answers with: shapes.py).

``extra="forbid"`` as everywhere: a field this server does not implement is a 400
naming it. What Anthropic's SDK and Claude-Code-style clients routinely send and what
changes nothing here is accepted: ``cache_control`` (the engines' prefix cache needs no
breakpoints, docs/prefix-caching.md), ``metadata.user_id``, ``service_tier`` and
``thinking: {"type": "disabled"}``. The request and response models are named as the
anthropic SDK names them (``...Param`` for what a client sends).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from serve.api.common.structured import FUNCTION_NAME, check_tool_choice
from serve.api.common.unsupported import outsider
from serve.api.openai.fields import Text
from serve.api.openai.schemas import (
    ChatCompletionRequest,
    ChatMessage,
)

# Anthropic names no cap on stop_sequences; each is matched against the answer's text
# at every chunk (serve/api/common/stops.py), so some bound keeps a request's cost in check.
MAX_STOP_SEQUENCES = 64
_BLOCK_TYPES = ("text", "tool_use", "tool_result")
_MEDIA_BLOCKS = ("image", "document")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    """A prompt-caching breakpoint: accepted, nothing to do (the prefix cache is automatic)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


# -- content blocks ----------------------------------------------------------------------


class TextBlockParam(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    citations: None = None  # the SDK may send it back, null, with a text block it received


class ToolUseBlockParam(_Strict):
    """A call the assistant made, sent back with the conversation."""

    type: Literal["tool_use"]
    id: Text = Field(min_length=1)
    name: Text
    input: dict[str, Any]
    cache_control: CacheControl | None = None


def _text_blocks_only(content):
    """A tool result's content: text blocks only (checked before the union is tried, so
    the client reads this rather than one error per member)."""
    if found := outsider(content, ("text",)):
        raise ValueError(
            f"block {found[0]} has type {found[1]!r}: a tool result's content is "
            "text only (the model reads text only)"
        )
    return content


class ToolResultBlockParam(_Strict):
    """What a call returned; ``is_error`` is accepted, the model reads the text."""

    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1)
    content: Text | list[TextBlockParam] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    _text_only = field_validator("content", mode="before")(_text_blocks_only)

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


ContentBlockParam = Annotated[
    TextBlockParam | ToolUseBlockParam | ToolResultBlockParam, Field(discriminator="type")
]


def _known_blocks_only(content):
    """Before the union is tried: an image or a document is a 400 naming the block."""
    if found := outsider(content, _BLOCK_TYPES):
        i, kind = found
        why = " (the model reads text only)" if kind in _MEDIA_BLOCKS else ""
        raise ValueError(
            f"content block {i} has type {kind!r}: only text, tool_use and tool_result "
            f"blocks are supported{why}"
        )
    return content


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlockParam]

    _known_only = field_validator("content", mode="before")(_known_blocks_only)

    @model_validator(mode="after")
    def _blocks_of_the_role(self):
        kinds = {block.type for block in self.blocks}
        if self.role == "user" and "tool_use" in kinds:
            raise ValueError("tool_use blocks are only allowed in assistant messages")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks are only allowed in user messages")
        return self

    @property
    def blocks(self) -> list:
        return [] if isinstance(self.content, str) else self.content

    def chat_messages(self) -> list[ChatMessage]:
        """As chat messages: an assistant's tool_use blocks become its ``tool_calls``; a
        user's tool_result blocks become ``tool`` messages, in order, before the text of
        the same message (Anthropic wants the results first in their message)."""
        if isinstance(self.content, str):
            return [ChatMessage(role=self.role, content=self.content)]
        texts = [{"type": "text", "text": b.text} for b in self.content if b.type == "text"]
        if self.role == "assistant":
            calls = [_tool_call(b) for b in self.content if b.type == "tool_use"]
            content = texts if texts or not calls else None
            return [ChatMessage(role="assistant", content=content, tool_calls=calls or None)]
        results = [
            ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=b.text)
            for b in self.content
            if b.type == "tool_result"
        ]
        return results + ([ChatMessage(role="user", content=texts)] if texts or not results else [])


def _tool_call(block: ToolUseBlockParam) -> dict:
    # ASCII: an input may hold a lone surrogate, which only JSON's escape can carry.
    arguments = json.dumps(block.input)
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": arguments},
    }


# -- tools -------------------------------------------------------------------------------


class ToolParam(_Strict):
    """A client tool: the model calls it, the client runs it."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # as chat's: unenforced keywords are then a 400

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, tool):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"tool type {kind!r} is one of Anthropic's server tools, not supported: "
                "send client tools ({name, description, input_schema}) and run them yourself"
            )
        return tool

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, schema):
        # A call's input is an object (a tool_use block's input), as Anthropic requires.
        if schema.get("type") != "object":
            raise ValueError('the input schema\'s type must be "object"')
        return schema

    def chat_tool(self) -> dict:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class ToolChoiceParam(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool to call, with type "tool"
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool_only(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is required with type "tool", and only with it')
        return self

    def chat_choice(self):
        """Chat's ``tool_choice``: any is required, tool a named function."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


# -- the request -------------------------------------------------------------------------


class Metadata(_Strict):
    user_id: Text | None = None


class ThinkingParam(_Strict):
    type: Literal["disabled"]


class _Conversation(_Strict):
    """What a message and a count of its tokens both read: the model, the system
    prompt, the messages and the tools."""

    model: Text
    messages: list[MessageParam] = Field(min_length=1)
    system: Text | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=128)
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    cache_control: CacheControl | None = None

    @field_validator("messages")
    @classmethod
    def _ends_with_the_user(cls, messages):
        # Anthropic continues a last assistant message (a prefill); the chat template
        # here always opens a new assistant turn, so the answer would not continue it.
        if messages[-1].role == "assistant":
            raise ValueError(
                "the last message is the assistant's (a prefill), which is not supported: "
                "end with a user message"
            )
        return messages

    @field_validator("messages")
    @classmethod
    def _results_answer_calls(cls, messages):
        """Each tool_result answers a tool_use of the assistant message right before it,
        as Anthropic requires (in its words)."""
        for i, message in enumerate(messages):
            results = [b.tool_use_id for b in message.blocks if b.type == "tool_result"]
            before = messages[i - 1].blocks if i else []
            made = {b.id for b in before if b.type == "tool_use"}
            unknown = [result for result in results if result not in made]
            if unknown:
                raise ValueError(
                    f"messages.{i}: unexpected tool_use_id found in tool_result blocks: "
                    f"{', '.join(unknown)}. Each tool_result block must have a corresponding "
                    "tool_use block in the previous message"
                )
        return messages

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice, info: ValidationInfo):
        tools = {tool.name for tool in info.data.get("tools") or []}
        calls = choice is not None and choice.type != "none"
        named = choice.name if calls and choice.type == "tool" else None
        check_tool_choice(calls, named, tools)
        return choice

    @field_validator("thinking", mode="before")
    @classmethod
    def _no_thinking(cls, thinking):
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind is not None and kind != "disabled":
            raise ValueError(
                f"thinking of type {kind!r} is not supported: the models here write no "
                'thinking blocks; leave it out or send {"type": "disabled"}'
            )
        return thinking

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request of the same turn (one choice)."""
        choice = self.tool_choice
        messages = [m for message in self.messages for m in message.chat_messages()]
        return ChatCompletionRequest(
            model=self.model,
            messages=self._system_messages() + messages,
            tools=[tool.chat_tool() for tool in self.tools] if self.tools else None,
            tool_choice=choice.chat_choice() if choice else None,
            parallel_tool_calls=False if choice and choice.disable_parallel_tool_use else None,
            **self._sampling(),
        )

    def _sampling(self) -> dict[str, Any]:
        return {}

    def _system_messages(self) -> list[ChatMessage]:
        if self.system is None or self.system == []:
            return []
        if isinstance(self.system, str):
            return [ChatMessage(role="system", content=self.system)]
        parts = [{"type": "text", "text": block.text} for block in self.system]
        return [ChatMessage(role="system", content=parts)]


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: what the model would read of a message."""


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        None, max_length=MAX_STOP_SEQUENCES
    )
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted: one tier here

    def chat_request(self) -> ChatCompletionRequest:
        # Chat holds stop to OpenAI's 4 strings; the engines and the stop-string cutter
        # take any number, and Anthropic's clients may send more: set past that check.
        request = super().chat_request()
        return request.model_copy(update={"stop": list(self.stop_sequences or [])})

    def _sampling(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,  # Anthropic's 0-1 lies within OpenAI's 0-2
            "top_p": self.top_p,
            "top_k": self.top_k,
            "user": self.metadata.user_id if self.metadata else None,
        }
