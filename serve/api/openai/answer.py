"""One chat answer as the Responses and Messages APIs give it: its text cut at the
first stop string and split into content and tool calls, whole or as events while it
streams. (Chat completions answers ``n`` choices with log probabilities, in OpenAI's
chunk shape: :mod:`serve.api.openai.routes` streams those.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from serve.api.common.backend import Backend
from serve.api.common.stops import StopStringCutter
from serve.api.common.tool_parsers import ToolCall, ToolCallParser, parse_whole
from serve.api.openai.prepare import ChatTurn
from serve.generation import GenerationChunk


@dataclass(frozen=True)
class Answer:
    """A whole answer; also the last event of a streamed one."""

    content: str
    calls: list[ToolCall]
    # "stop" | "length", or "tool_calls": the model stopped after calling tools
    finish_reason: str
    stop_string: str | None  # the stop string it ended at (cut from the content)
    last: GenerationChunk  # the token counts

    @property
    def usage(self) -> tuple[int, int, int]:
        """(input tokens, output tokens, input tokens read from the prefix cache)."""
        last = self.last
        return last.num_input_tokens, last.num_output_tokens, last.num_cached_tokens


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int  # the call's place among the answer's calls
    call_id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str  # the next piece of the call's JSON arguments


Event = ContentDelta | CallStarted | ArgumentsDelta | Answer


def _finish(reason: str | None, calls: list[ToolCall]) -> str:
    """An answer that called tools and ended on its own ends with ``tool_calls``."""
    reason = reason or "stop"
    return "tool_calls" if calls and reason == "stop" else reason


async def whole_answer(backend: Backend, turn: ChatTurn) -> Answer:
    params = turn.params[0]
    text, last = await backend.collect(turn.model, params)
    cutter = StopStringCutter(params.stop)
    kept = cutter.feed(text)
    finish = "stop" if cutter.stopped else last.finish_reason
    kept += cutter.flush()  # empty once a stop string was found
    content, calls = parse_whole(turn.syntax, kept) if turn.syntax else (kept, [])
    return Answer(content, calls, _finish(finish, calls), cutter.stop, last)


class AnswerStream:
    """A started answer: the prompt's token counts, known from its first chunk, and its
    events (``async for``), its :class:`Answer` last; ``aclose`` stops the engine's
    sequence."""

    def __init__(self, first: GenerationChunk, events: AsyncIterator[Event]):
        self.input_tokens = first.num_input_tokens
        self.cached_tokens = first.num_cached_tokens
        self._events = events

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events

    async def aclose(self) -> None:
        await self._events.aclose()


async def start_answer(backend: Backend, turn: ChatTurn) -> AnswerStream:
    """The answer, started. The first chunk is awaited here, so a refusal is still an
    HTTP status; a failure later is raised by the iterator (an
    :class:`serve.api.common.errors.APIError` where it is the client's to read)."""
    first, rest = await backend.start(turn.model, turn.params[0])
    return AnswerStream(first, _events(first, rest, turn))


async def _events(first: GenerationChunk, rest, turn: ChatTurn) -> AsyncIterator[Event]:
    cutter = StopStringCutter(turn.params[0].stop)
    parser = ToolCallParser(turn.syntax) if turn.syntax else None
    content: list[str] = []  # without a parser: the answer's text
    chunk, finish = first, None
    try:
        async for chunk in _chained(first, rest):
            text = cutter.feed(chunk.text)
            finish = "stop" if cutter.stopped else chunk.finish_reason
            if finish:
                text += cutter.flush()
            if parser is None:
                content.append(text)
                if text:
                    yield ContentDelta(text)
            else:
                for event in _parsed(parser, text, finish is not None):
                    yield event
            if finish:
                break
    finally:
        await rest.aclose()  # a stop string ends the answer: the engine stops too
    calls = parser.calls if parser else []
    text = parser.content if parser else "".join(content)
    yield Answer(text, calls, _finish(finish, calls), cutter.stop, chunk)


def _parsed(parser: ToolCallParser, text: str, last: bool) -> list[Event]:
    """The events ``text`` adds: content first, then each call's opening and argument
    pieces in the calls' order (a piece of text may end one call and begin the next)."""
    delta = parser.feed(text)
    content = delta.content + (parser.finish().content if last else "")
    events: list[Event] = [ContentDelta(content)] if content else []
    started = {index: CallStarted(index, cid, name) for index, cid, name in delta.started}
    indexes = sorted(set(started) | {index for index, _ in delta.arguments})
    for index in indexes:
        if index in started:
            events.append(started[index])
        events += [ArgumentsDelta(i, piece) for i, piece in delta.arguments if i == index]
    return events


async def _chained(first: GenerationChunk, rest) -> AsyncIterator[GenerationChunk]:
    yield first
    async for chunk in rest:
        yield chunk
