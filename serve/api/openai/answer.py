"""One chat answer as the Responses and Messages APIs give it: its text cut at the
first stop string and split into content and tool calls, with its tokens' log
probabilities where asked, whole or as events while it streams. (Chat completions
answers ``n`` choices in OpenAI's chunk shape: :mod:`serve.api.openai.routes` streams
those.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from serve.api.common.backend import Backend
from serve.api.common.stops import StopStringCutter
from serve.api.common.tool_parsers import ToolCall, ToolCallParser, parse_whole
from serve.api.openai.endpoints import CHAT
from serve.api.openai.log_probs import LogProbs
from serve.api.openai.prepare import ChatTurn
from serve.api.openai.shapes import ChatTokenLogProb
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
    # Every generated token's, as chat completions gives them (None: not asked for).
    log_probs: list[ChatTokenLogProb] | None = None

    @property
    def usage(self) -> tuple[int, int, int]:
        """(input tokens, output tokens, input tokens read from the prefix cache)."""
        last = self.last
        return last.num_input_tokens, last.num_output_tokens, last.num_cached_tokens


@dataclass(frozen=True)
class ContentDelta:
    text: str
    # The tokens' that came since the last delta (asked for: see Answer.log_probs).
    log_probs: list[ChatTokenLogProb] = field(default_factory=list)


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
    log_probs = _log_probs(backend, turn)
    tokens = log_probs(last) if log_probs else None
    return Answer(content, calls, _finish(finish, calls), cutter.stop, last, tokens)


def _log_probs(backend: Backend, turn: ChatTurn):
    """A chunk's tokens' log probabilities, as chat gives them; None where not asked."""
    if not turn.params[0].return_log_probs:
        return None
    shaped = LogProbs(backend, turn.model, CHAT, [""])
    return lambda chunk: shaped(0, chunk).content


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
    return AnswerStream(first, _events(first, rest, turn, _log_probs(backend, turn)))


async def _events(first: GenerationChunk, rest, turn: ChatTurn, log_probs) -> AsyncIterator[Event]:
    cutter = StopStringCutter(turn.params[0].stop)
    parser = ToolCallParser(turn.syntax) if turn.syntax else None
    content: list[str] = []  # without a parser: the answer's text
    tokens = _TokenLog() if log_probs else None
    chunk, finish = first, None
    try:
        async for chunk in _chained(first, rest):
            if tokens is not None:
                tokens.add(log_probs(chunk))
            text = cutter.feed(chunk.text)
            finish = "stop" if cutter.stopped else chunk.finish_reason
            if finish:
                text += cutter.flush()
            if parser is None:
                content.append(text)
                events = [ContentDelta(text)] if text else []
            else:
                events = _parsed(parser, text, finish is not None)
            for event in events:
                yield tokens.attach(event) if tokens is not None else event
            if finish:
                break
    finally:
        await rest.aclose()  # a stop string ends the answer: the engine stops too
    if tokens is not None and parser is None:  # the last tokens brought no text
        unsent = tokens.attach(ContentDelta(""))
        if unsent.log_probs:
            yield unsent
    calls = parser.calls if parser else []
    text = parser.content if parser else "".join(content)
    whole = tokens.whole if tokens is not None else None
    yield Answer(text, calls, _finish(finish, calls), cutter.stop, chunk, whole)


class _TokenLog:
    """A streamed answer's token log probabilities: all of them, and those not yet sent
    with a content delta (a chunk whose text is held back, by a stop string that may be
    starting or a tool call, sends its tokens' with the next delta; an answer without
    calls sends the last ones, the end token's, in a delta of no text)."""

    def __init__(self):
        self.whole: list[ChatTokenLogProb] = []
        self._unsent: list[ChatTokenLogProb] = []

    def add(self, entries: list[ChatTokenLogProb]) -> None:
        self.whole += entries
        self._unsent += entries

    def attach(self, event: Event) -> Event:
        if not isinstance(event, ContentDelta) or not self._unsent:
            return event
        sent, self._unsent = self._unsent, []
        return ContentDelta(event.text, sent)


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
