"""A response streamed as the Responses API's events: each output item opened, filled
and closed in turn, the whole response last (or ``response.failed``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from typing import get_args

from serve.api.common.answer import (
    Answer,
    AnswerStream,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    LogProbsOf,
    answer_events,
)
from serve.api.common.errors import APIError, InternalError
from serve.api.common.sse import one_line
from serve.api.openai.responses.draft import Draft, call_item, message_item, save, text_part
from serve.api.openai.responses.shapes import (
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItem,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    StreamEvent,
)
from serve.api.openai.responses.store import ResponseStore

log = logging.getLogger("ray.serve")


class _Emitter:
    """SSE frames of the Responses API: ``event:`` names the type; every event carries
    its ``sequence_number``."""

    def __init__(self):
        self._sequence = 0

    def __call__(self, event: type[StreamEvent], **fields) -> str:
        kind = _kind(event)
        payload = event(type=kind, sequence_number=self._sequence, **fields)
        self._sequence += 1
        data = one_line(payload.model_dump_json(exclude_unset=True))
        return f"event: {kind}\ndata: {data}\n\n"


@functools.cache
def _kind(event: type[StreamEvent]) -> str:
    """An event's ``type``: the one value its ``Literal`` allows."""
    return get_args(event.model_fields["type"].annotation)[0]


class _OpenItems:
    """The output items of a streamed answer, the last one open while text or
    arguments still arrive; each method returns the events it makes."""

    def __init__(self, emit: _Emitter):
        self.items: list[ResponseOutputItem] = []
        self._emit = emit
        self._open: ResponseOutputItem | None = None

    def text(self, piece: str, log_probs: list) -> list[str]:
        events = [] if self._is_open("message") else self.open_message()
        part = self._open.content[0]
        part.text += piece
        part.logprobs += log_probs
        delta = {"content_index": 0, "delta": piece, "logprobs": log_probs}
        return events + [self._emit(ResponseTextDeltaEvent, **self._at(), **delta)]

    def last_log_probs(self, log_probs: list | None) -> None:
        """The whole answer's, on its text (the deltas carried those that came with
        text; the last tokens may have brought none, cut at a stop string)."""
        if log_probs is not None and self._is_open("message"):
            self._open.content[0].logprobs = log_probs

    def open_message(self) -> list[str]:
        events = self._add(message_item())
        part = text_part()
        return events + [
            self._emit(ResponseContentPartAddedEvent, **self._at(), content_index=0, part=part)
        ]

    def call(self, call_id: str, name: str) -> list[str]:
        return self._add(call_item(call_id, name))

    def arguments(self, piece: str) -> list[str]:
        self._open.arguments += piece
        return [self._emit(ResponseFunctionCallArgumentsDeltaEvent, **self._at(), delta=piece)]

    def close(self, status: str = "completed") -> list[str]:
        if self._open is None:
            return []
        item, at = self._open, self._at()
        self._open = None
        item.status = status
        if item.type == "message":
            part = item.content[0]
            done = {"content_index": 0, "text": part.text, "logprobs": part.logprobs}
            events = [
                self._emit(ResponseTextDoneEvent, **at, **done),
                self._emit(ResponseContentPartDoneEvent, **at, content_index=0, part=part),
            ]
        else:
            call = {"name": item.name, "arguments": item.arguments}
            events = [self._emit(ResponseFunctionCallArgumentsDoneEvent, **at, **call)]
        index = at["output_index"]
        return events + [self._emit(ResponseOutputItemDoneEvent, output_index=index, item=item)]

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open.type == kind

    def _at(self) -> dict:
        """Where the open item is (the last one)."""
        return {"item_id": self._open.id, "output_index": len(self.items) - 1}

    def _add(self, item: ResponseOutputItem) -> list[str]:
        events = self.close()
        self.items.append(item)
        self._open = item
        added = {"output_index": len(self.items) - 1, "item": _opening(item)}
        return events + [self._emit(ResponseOutputItemAddedEvent, **added)]


def _opening(item: ResponseOutputItem) -> ResponseOutputItem:
    """An item as ``output_item.added`` shows it: nothing in it yet."""
    if item.type == "message":
        return item.model_copy(update={"content": []})
    return item.model_copy(update={"arguments": ""})


async def response_events(
    store: ResponseStore | None,
    draft: Draft,
    stream: AnswerStream,
    history: list[dict],
    log_probs: LogProbsOf | None = None,
) -> AsyncIterator[str]:
    """The response's events as ``stream`` brings its answer (``log_probs``: a chunk's
    tokens' as the output text's entries, where the request included them)."""
    events = answer_events(stream, log_probs)
    emit = _Emitter()
    output = _OpenItems(emit)
    try:
        yield emit(ResponseCreatedEvent, response=draft.snapshot("in_progress", []))
        yield emit(ResponseInProgressEvent, response=draft.snapshot("in_progress", []))
        async for event in events:
            if isinstance(event, ContentDelta):
                frames = output.text(event.text, event.log_probs)
            elif isinstance(event, CallStarted):
                frames = output.call(event.call_id, event.name)
            elif isinstance(event, ArgumentsDelta):
                frames = output.arguments(event.text)
            else:
                frames = await _end(store, draft, event, output, history, emit)
            for frame in frames:
                yield frame
    except APIError as error:  # mid-stream: the response fails, never a cut stream
        for frame in _failure(draft, error, output, emit):
            yield frame
    except Exception:
        log.exception("response %s failed after its first event", draft.id)
        error = InternalError("internal server error; see the server log")
        for frame in _failure(draft, error, output, emit):
            yield frame
    finally:  # done, failed or the client left: the engine's stream is closed
        await events.aclose()
        await stream.aclose()  # also where the client left before the first step


async def _end(
    store: ResponseStore | None, draft: Draft, answer: Answer, output: _OpenItems, history, emit
) -> list[str]:
    """The last events: the open item closed (an answer with no text and no call gets
    one empty message) and the whole response, once stored."""
    frames = [] if output.items else output.open_message()
    output.last_log_probs(answer.log_probs)
    cut = answer.finish_reason == "length"
    frames += output.close("incomplete" if cut else "completed")
    response = draft.finished(answer, output.items)
    await save(store, draft, response, history)
    kind = ResponseIncompleteEvent if cut else ResponseCompletedEvent
    return frames + [emit(kind, response=response)]


def _failure(draft: Draft, error: APIError, output: _OpenItems, emit: _Emitter) -> list[str]:
    frames = output.close("incomplete")
    return frames + [emit(ResponseFailedEvent, response=draft.failed(error, output.items))]
