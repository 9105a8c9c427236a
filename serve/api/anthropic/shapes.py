"""What Anthropic's Messages API answers: the message and its stream's events, named as
the anthropic SDK names them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
)

# -- the answer --------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Usage(BaseModel):
    """Anthropic's count: ``input_tokens`` are the prompt's tokens not read from the
    prefix cache, ``cache_read_input_tokens`` those read from it (their sum is the
    prompt); nothing is written to a cache on request, so no creation tokens."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage


# -- the stream --------------------------------------------------------------------------
# Anthropic's events, named as its SDK names them. Every field is sent (``model_dump``,
# as the message is): an event's ``type`` is its default, the rest is given.


class RawMessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class RawContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")]


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJSONDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str  # a piece of the call's input, as the model wrote it


class RawContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    # No discriminator: a union given an instance of one of its models takes it as it
    # is, which costs less per token than finding the model by its type.
    delta: TextDelta | InputJSONDelta


class RawContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None


class RawMessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: Usage  # the whole count, as at the end of a message


class RawMessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class ErrorObject(BaseModel):
    type: str  # serve.api.common.errors names Anthropic's error types
    message: str


class ErrorEvent(BaseModel):
    """A failure after the stream's first byte (before it, the error is the answer)."""

    type: Literal["error"] = "error"
    error: ErrorObject


MessageStreamEvent = Annotated[
    RawMessageStartEvent
    | PingEvent
    | RawContentBlockStartEvent
    | RawContentBlockDeltaEvent
    | RawContentBlockStopEvent
    | RawMessageDeltaEvent
    | RawMessageStopEvent
    | ErrorEvent,
    Field(discriminator="type"),
]
