"""One choice's answer, the same in every API: the engine's chunks with the text cut at
the first stop string and split into content and tool calls (the model's call syntax),
whole (:func:`whole_answer`) or step by step as it streams (:func:`start_answer`).

Chat completions and completions shape each :class:`Step` as a chunk of their choice;
the Responses and Messages APIs read the stream as events (:func:`answer_events`): text
deltas, each call's opening and argument pieces in order, and the :class:`Answer` last.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from serve.api.common.backend import Backend
from serve.api.common.stops import StopStringCutter
from serve.api.common.tool_parsers import CallSyntax, Delta, ToolCall, ToolCallParser, parse_whole
from serve.config import ModelConfig
from serve.generation import GenerateParams, GenerationChunk

# A chunk's tokens' log probabilities, in the shape its API gives them.
LogProbsOf = Callable[[GenerationChunk], Any]


@dataclass(frozen=True)
class Reading:
    """How a choice's text is read into its answer."""

    stops: tuple[str, ...] = ()  # the answer ends at the first (the request's stop strings)
    syntax: CallSyntax | None = None  # the model's call syntax (None: all of it is content)
    keep_stop: bool = False  # the stop string stays at the content's end (vLLM's option)
    echo: str = ""  # completions' echo: the prompt, before the content


@dataclass(frozen=True)
class Answer:
    """A whole answer; also what a streamed one came to, once it ended."""

    content: str
    calls: list[ToolCall]
    # "stop" | "length", or "tool_calls": the model stopped after calling tools
    finish_reason: str
    stop_string: str | None  # the stop string it ended at
    last: GenerationChunk  # the token counts
    log_probs: Any = None  # its tokens', where the caller asked (see LogProbsOf)

    @property
    def usage(self) -> tuple[int, int, int]:
        """(input tokens, output tokens, input tokens read from the prefix cache)."""
        last = self.last
        return last.num_input_tokens, last.num_output_tokens, last.num_cached_tokens


async def whole_answer(
    backend: Backend,
    model: ModelConfig,
    params: GenerateParams,
    reading: Reading = Reading(),
    log_probs: LogProbsOf | None = None,
) -> Answer:
    text, last = await backend.collect(model, params)
    cutter = StopStringCutter(reading.stops, reading.keep_stop)
    kept = cutter.feed(text)
    finish = "stop" if cutter.stopped else last.finish_reason
    kept = reading.echo + kept + cutter.flush()  # nothing is held once a stop was found
    content, calls = parse_whole(reading.syntax, kept) if reading.syntax else (kept, [])
    tokens = log_probs(last) if log_probs else None
    return Answer(content, calls, _finish(finish, calls), cutter.stop, last, tokens)


def _finish(reason: str | None, calls: list[ToolCall]) -> str:
    """An answer that called tools and ended on its own ends with ``tool_calls``."""
    reason = reason or "stop"
    return "tool_calls" if calls and reason == "stop" else reason


# -- streamed ---------------------------------------------------------------------------


class Step(NamedTuple):
    """What one engine chunk adds to a streamed answer. (A tuple, not a dataclass: one
    is made per chunk of every stream, and a tuple is made fastest.)"""

    text: str  # its content: stop strings cut, tool calls taken out
    calls: Delta | None  # the tool calls' openings and argument pieces it adds, if any
    chunk: GenerationChunk  # its tokens (their log probabilities), the counts so far
    finish_reason: str | None  # on the last step, as Answer.finish_reason


class AnswerStream:
    """A started answer: the prompt's token counts, known from its first chunk; its
    steps (``async for``), one per engine chunk, the last with the finish reason;
    ``answer`` once that was read. ``aclose`` stops the engine's sequence (a stop string
    closes it too)."""

    def __init__(self, first: GenerationChunk, rest, reading: Reading):
        self.input_tokens = first.num_input_tokens
        self.cached_tokens = first.num_cached_tokens
        self.reading = reading
        self.latest = first  # the latest chunk read: the token counts so far
        self.answer: Answer | None = None
        # Without stop strings nothing is held back: no cutter on the token path.
        self._cutter = StopStringCutter(reading.stops, reading.keep_stop) if reading.stops else None
        self._parser = ToolCallParser(reading.syntax) if reading.syntax else None
        self._content: list[str] = []  # without a parser: the content so far
        self._rest = rest
        self._steps = self._read(first, rest)

    def __aiter__(self) -> AsyncIterator[Step]:
        return self._steps

    async def aclose(self) -> None:
        await self._steps.aclose()
        await self._rest.aclose()  # also where no step was read

    async def _read(self, first: GenerationChunk, rest) -> AsyncIterator[Step]:
        try:
            step = self._step(first, self.reading.echo)
            yield step
            plain = self._cutter is None and self._parser is None
            if step.finish_reason is None:
                async for chunk in rest:
                    if plain and chunk.finish_reason is None:  # most chunks: as they came
                        self.latest = chunk
                        self._content.append(chunk.text)
                        yield Step(chunk.text, None, chunk, None)
                        continue
                    step = self._step(chunk)
                    yield step
                    if step.finish_reason is not None:
                        break
            if self.answer is None:  # the engine's stream ended without saying why
                self._end(None, self.latest)
            elif not (self._cutter and self._cutter.stopped):
                # The engine ended the answer: its stream ends by itself now. Closed before
                # that, the ingress would cancel the replica's call, a round trip for
                # nothing. (A stop string found here closes it: the engine may go on.)
                async for _ in rest:
                    pass
        finally:
            await rest.aclose()

    def _step(self, chunk: GenerationChunk, before: str = "") -> Step:
        self.latest = chunk
        text, finish, cutter = chunk.text, chunk.finish_reason, self._cutter
        if cutter is not None:
            text = cutter.feed(text)
            finish = "stop" if cutter.stopped else finish
            if finish:
                text += cutter.flush()
        if before:
            text = before + text
        calls = None
        if self._parser is None:
            self._content.append(text)
        else:
            delta = self._parser.feed(text)
            if finish:
                delta.content += self._parser.finish().content
            text = delta.content
            calls = delta if delta.started or delta.arguments else None
        if finish:
            finish = self._end(finish, chunk)
        return Step(text, calls, chunk, finish)

    def _end(self, reason: str | None, last: GenerationChunk) -> str:
        parser = self._parser
        calls = parser.calls if parser else []
        content = parser.content if parser else "".join(self._content)
        stop = self._cutter.stop if self._cutter else None
        self.answer = Answer(content, calls, _finish(reason, calls), stop, last)
        return self.answer.finish_reason


async def start_answer(
    backend: Backend, model: ModelConfig, params: GenerateParams, reading: Reading = Reading()
) -> AnswerStream:
    """The answer, started. The first chunk is awaited here, so a refusal is still an
    HTTP status; a failure later is raised by the steps (an
    :class:`serve.api.common.errors.APIError` where it is the client's to read)."""
    first, rest = await backend.start(model, params)
    return AnswerStream(first, rest, reading)


# -- as events --------------------------------------------------------------------------


@dataclass(frozen=True)
class ContentDelta:
    text: str
    # The tokens' that came since the last delta (where asked: see answer_events).
    log_probs: list = field(default_factory=list)


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


async def answer_events(
    stream: AnswerStream, log_probs: Callable[[GenerationChunk], list] | None = None
) -> AsyncIterator[Event]:
    """The streamed answer as events, the :class:`Answer` last (with every token's log
    probabilities where ``log_probs`` gives a chunk's as a list)."""
    tokens = _TokenLog() if log_probs else None
    try:
        async for step in stream:
            if tokens is not None:
                tokens.add(log_probs(step.chunk))
            for event in _events(step):
                yield tokens.attach(event) if tokens is not None else event
    finally:  # also when the reader left: the engine's sequence stops
        await stream.aclose()
    if tokens is None:
        yield stream.answer
        return
    if stream.reading.syntax is None:  # the last tokens brought no text
        unsent = tokens.attach(ContentDelta(""))
        if unsent.log_probs:
            yield unsent
    yield replace(stream.answer, log_probs=tokens.whole)


def _events(step: Step) -> list[Event]:
    """The events a step adds: content first, then each call's opening and argument
    pieces in the calls' order (a piece of text may end one call and begin the next)."""
    events: list[Event] = [ContentDelta(step.text)] if step.text else []
    delta = step.calls
    if delta is None:
        return events
    started = {index: CallStarted(index, cid, name) for index, cid, name in delta.started}
    indexes = sorted(set(started) | {index for index, _ in delta.arguments})
    for index in indexes:
        if index in started:
            events.append(started[index])
        events += [ArgumentsDelta(i, piece) for i, piece in delta.arguments if i == index]
    return events


class _TokenLog:
    """A streamed answer's token log probabilities: all of them, and those not yet sent
    with a content delta (a step whose text is held back, by a stop string that may be
    starting or a tool call, sends its tokens' with the next delta; an answer without
    calls sends the last ones, the end token's, in a delta of no text)."""

    def __init__(self):
        self.whole: list = []
        self._unsent: list = []

    def add(self, entries: list) -> None:
        self.whole += entries
        self._unsent += entries

    def attach(self, event: Event) -> Event:
        if not isinstance(event, ContentDelta) or not self._unsent:
            return event
        sent, self._unsent = self._unsent, []
        return ContentDelta(event.text, sent)
