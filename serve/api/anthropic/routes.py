"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A message is one chat turn on the path every chat-shaped API shares: the request
becomes a chat request (:meth:`MessagesRequest.chat_request`) for
:func:`serve.api.openai.prepare.chat_turn` (model, limits, template, guides, call syntax), and
the answer of :mod:`serve.api.common.answer` is shaped here as Anthropic's message, whole or
as its stream of events. Errors on this path have Anthropic's shape
(:mod:`serve.api.common.errors`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from serve.api.anthropic.schemas import (
    CountTokensRequest,
    MessagesRequest,
)
from serve.api.anthropic.shapes import (
    ErrorEvent,
    InputJSONDelta,
    Message,
    MessageDelta,
    MessageStreamEvent,
    PingEvent,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    StopReason,
    TextBlock,
    TextDelta,
    ToolUseBlock,
    Usage,
)
from serve.api.common.answer import (
    Answer,
    AnswerStream,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    Event,
    answer_events,
)
from serve.api.common.auth import require_messages_api_key
from serve.api.common.errors import MESSAGES_PATH, APIError, InternalError, anthropic_body
from serve.api.common.sse import EventStream, one_line
from serve.api.openai.prepare import BackendDep, chat_turn, count_prompt_tokens, guided
from serve.api.openai.schemas import ChatCompletionRequest

log = logging.getLogger("ray.serve")

messages_router = APIRouter(dependencies=[Depends(require_messages_api_key)])


@messages_router.post(MESSAGES_PATH)
async def create_message(body: MessagesRequest, request: Request, backend: BackendDep):
    chat = _chat_request(body)
    turn = await guided(functools.partial(chat_turn, chat, request, backend), chat)
    message_id = f"msg_{uuid.uuid4().hex}"
    if not body.stream:
        answer = await turn.whole_answer(backend)
        return JSONResponse(_message(message_id, turn.served, answer).model_dump())
    stream = await turn.start_answer(backend)
    return EventStream(_stream(message_id, turn.served, stream))


@messages_router.post(MESSAGES_PATH + "/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, backend: BackendDep):
    """The message's input tokens, as its answer's usage would count them (the cached
    and the uncached together): its prompt, tokenized off the event loop that relays
    the streams."""
    chat = _chat_request(body)
    count = functools.partial(count_prompt_tokens, chat, request, backend)
    return {"input_tokens": await asyncio.to_thread(count)}


def _chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    try:
        return body.chat_request()
    except ValidationError as error:  # what the blocks say only once they are messages
        raise APIError(f"messages: {error.errors()[0]['msg']}", "messages") from None


def tool_use_id(call_id: str) -> str:
    """Anthropic's id style for the project's call ids; the client sends it back in its
    tool_result, which reaches the chat template as the call's id."""
    return "toolu_" + call_id.removeprefix("call_")


def _stop(answer: Answer) -> tuple[StopReason, str | None]:
    """The stop reason, and the stop sequence it names (only with ``stop_sequence``)."""
    if answer.finish_reason == "tool_calls":
        return "tool_use", None
    if answer.finish_reason == "length":
        return "max_tokens", None
    if answer.stop_string is not None:
        return "stop_sequence", answer.stop_string
    return "end_turn", None


def _usage(answer: Answer) -> Usage:
    prompt, output, cached = answer.usage
    return Usage(input_tokens=prompt - cached, output_tokens=output, cache_read_input_tokens=cached)


def _has_text(answer: Answer) -> bool:
    """Whether the answer's content is a text block: as Anthropic answers, none for an
    answer of calls with only whitespace (or nothing) before them."""
    return bool(answer.content.strip()) if answer.calls else bool(answer.content)


def _message(message_id: str, model: str, answer: Answer) -> Message:
    content: list[TextBlock | ToolUseBlock] = []
    if _has_text(answer):
        content.append(TextBlock(text=answer.content))
    for call in answer.calls:
        arguments = json.loads(call.arguments)  # whole answers hold parsed calls only
        content.append(ToolUseBlock(id=tool_use_id(call.id), name=call.name, input=arguments))
    reason, sequence = _stop(answer)
    return Message(
        id=message_id,
        model=model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=_usage(answer),
    )


# -- the stream --------------------------------------------------------------------------


def _sse(event: BaseModel) -> str:
    return f"event: {event.type}\ndata: {one_line(event.model_dump_json())}\n\n"


async def _stream(message_id: str, model: str, stream: AnswerStream):
    """Anthropic's events: message_start, ping, each content block opened, filled and
    closed in order, message_delta with the stop reason and the usage, message_stop. An
    error after the first byte is an ``error`` event, never a cut stream."""
    cached = stream.cached_tokens
    empty = Message(
        id=message_id,
        model=model,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=Usage(
            input_tokens=stream.input_tokens - cached,
            output_tokens=0,
            cache_read_input_tokens=cached,
        ),
    )
    blocks = _Blocks()
    try:
        yield _sse(RawMessageStartEvent(message=empty))
        yield _sse(PingEvent())
        async for event in answer_events(stream):
            for shaped in blocks.shape(event):
                yield _sse(shaped)
        yield _sse(RawMessageStopEvent())
    except APIError as error:
        yield _sse(ErrorEvent.model_validate(anthropic_body(error)))
    except Exception:
        log.exception("message stream %s failed after its first byte", message_id)
        error = InternalError("internal server error; see the server log")
        yield _sse(ErrorEvent.model_validate(anthropic_body(error)))
    finally:
        await stream.aclose()  # also when the client left: the engine stops


class _Blocks:
    """Turns the answer's events into Anthropic's content block events: a block stays
    open until one of another kind begins (a text block closes before a call's opens).
    Whitespace before any block or between calls is held: it opens a text block only
    where the whole answer would have one (:func:`_has_text`)."""

    def __init__(self):
        self.index = -1  # the open block's (the last opened)
        self.open: str | None = None  # "text" | "tool_use" | None
        self.held = ""  # whitespace not yet in a block

    def shape(self, event: Event) -> list[MessageStreamEvent]:
        if isinstance(event, ContentDelta):
            return self._text(event.text)
        if isinstance(event, CallStarted):
            self.held = ""
            call = ToolUseBlock(id=tool_use_id(event.call_id), name=event.name, input={})
            return self._start(call)
        if isinstance(event, ArgumentsDelta):
            return [self._delta(InputJSONDelta(partial_json=event.text))]
        return self._end(event)

    def _text(self, text: str) -> list[MessageStreamEvent]:
        if self.open == "text":
            return [self._delta(TextDelta(text=text))]
        if not text.strip():
            self.held += text
            return []
        text, self.held = self.held + text, ""
        return self._start(TextBlock(text="")) + [self._delta(TextDelta(text=text))]

    def _start(self, block: TextBlock | ToolUseBlock) -> list[MessageStreamEvent]:
        events = self._close()
        self.index, self.open = self.index + 1, block.type
        return events + [RawContentBlockStartEvent(index=self.index, content_block=block)]

    def _delta(self, delta: TextDelta | InputJSONDelta) -> RawContentBlockDeltaEvent:
        return RawContentBlockDeltaEvent(index=self.index, delta=delta)

    def _close(self) -> list[MessageStreamEvent]:
        if self.open is None:
            return []
        self.open = None
        return [RawContentBlockStopEvent(index=self.index)]

    def _end(self, answer: Answer) -> list[MessageStreamEvent]:
        events = []
        if self.held and not answer.calls:  # an answer of whitespace only
            events += self._start(TextBlock(text=""))
            events.append(self._delta(TextDelta(text=self.held)))
        events += self._close()
        reason, sequence = _stop(answer)
        delta = MessageDelta(stop_reason=reason, stop_sequence=sequence)
        return events + [RawMessageDeltaEvent(delta=delta, usage=_usage(answer))]
