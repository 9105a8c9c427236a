"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A response is one chat turn on the path every chat-shaped API shares
(:func:`serve.api.openai.prepare.chat_turn`, :mod:`serve.api.openai.answer`): its input items become
chat messages, its function tools and ``text.format`` the same guides as chat's. With
``store`` (OpenAI's default) the response and its conversation go to the operator's
response store (:mod:`serve.api.openai.responses.store`), where ``previous_response_id``
finds them: the next turn's prompt is that conversation, then the new input. What one
API key stores only that key reads, chains from or deletes; to any other it is the
same 404 as an id never stored.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal, get_args

from fastapi import APIRouter, Depends, Query, Request
from pydantic import ValidationError

from serve.api.common.auth import key_owner, require_api_key
from serve.api.common.errors import APIError, InternalError, NotFound, TooLarge
from serve.api.common.sse import EventStream, json_response, one_line
from serve.api.openai.answer import (
    Answer,
    AnswerStream,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    start_answer,
    whole_answer,
)
from serve.api.openai.prepare import BackendDep, ChatTurn, chat_turn, guided
from serve.api.openai.responses.input_items import input_items, page, with_ids
from serve.api.openai.responses.schemas import (
    IncompleteDetails,
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseError,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItem,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
    StreamEvent,
    dump_items,
)
from serve.api.openai.responses.store import OwnedStore, RecordTooLarge, ResponseStore
from serve.api.openai.schemas import ChatCompletionRequest

log = logging.getLogger("ray.serve")

responses_router = APIRouter(dependencies=[Depends(require_api_key)])


async def _owned_store(request: Request, backend: BackendDep) -> ResponseStore | None:
    """The response store as the caller's API key sees it: what one key stores, no
    other key reads, chains from or deletes. None where the operator keeps none."""
    store = backend.response_store
    return None if store is None else OwnedStore(store, key_owner(request))


StoreDep = Annotated[ResponseStore | None, Depends(_owned_store)]


@responses_router.post("/v1/responses")
async def create_response(
    body: ResponsesRequest, request: Request, backend: BackendDep, store: StoreDep
):
    conversation = await _previous_conversation(store, body.previous_response_id)
    try:
        chat = _chat_request(body, conversation)
        turn = await guided(functools.partial(chat_turn, chat, request, backend), chat)
        if body.stream:
            started = await start_answer(backend, turn)
        else:
            started = await whole_answer(backend, turn)
    except APIError as error:  # named as this API names the field
        error.param = _renamed(error.param)
        raise
    draft = _Draft(body, turn, stored=body.store and store is not None)
    history = conversation + with_ids(dump_items(body.items))
    if not body.stream:
        response = draft.finished(started, _output_items(started))
        await _save(store, draft, response, history)
        return json_response(response)
    return EventStream(_events(store, draft, started, history))


@responses_router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, store: StoreDep):
    return (await _stored(store, response_id, "response_id"))["response"]


@responses_router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    store: StoreDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query()] = None,  # image URLs and such: none here
):
    record = await _stored(store, response_id, "response_id")
    return page(input_items(record), after, limit, order)


@responses_router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, store: StoreDep):
    if store is None or not await store.delete(response_id):
        raise _not_found(response_id, "response_id")
    return {"id": response_id, "object": "response", "deleted": True}


# -- the turn --------------------------------------------------------------------------


async def _previous_conversation(
    store: ResponseStore | None, response_id: str | None
) -> list[dict]:
    """The items of the conversation a previous response ended (its input, its output)."""
    if response_id is None:
        return []
    if store is None:
        raise APIError(
            "previous_response_id needs stored responses, and this server keeps none "
            "(responses.store is none in its Serve config): send the whole conversation",
            "previous_response_id",
        )
    return (await _stored(store, response_id, "previous_response_id"))["conversation"]


async def _stored(store: ResponseStore | None, response_id: str, param: str) -> dict:
    record = await store.get(response_id) if store is not None else None
    if record is None:
        raise _not_found(response_id, param)
    return record


def _not_found(response_id: str, param: str) -> NotFound:
    return NotFound(
        f"no stored response with id {response_id!r} (never stored, deleted or expired)",
        param,
        code="response_not_found",
    )


def _chat_request(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body.chat_request(conversation))
    except ValidationError as error:  # what the items say only once they are messages
        first = error.errors()[0]
        raise APIError(f"input: {first['msg']}", "input") from None


# Chat's fields that a refusal may name, as the Responses API calls them (longest first).
_FIELDS = {
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "messages": "input",
}


def _renamed(param: str | None) -> str | None:
    for chat, ours in _FIELDS.items():
        if param == chat or (param or "").startswith(chat + "."):
            return ours + param[len(chat) :]
    return param


async def _save(
    store: ResponseStore | None, draft: _Draft, response: Response, history: list[dict]
) -> None:
    if draft.stored:
        stored = response.model_dump(exclude_unset=True)  # as it went on the wire
        record = {
            "response": stored,
            "conversation": history + stored["output"],
            "input_count": len(draft.items),
        }
        try:
            await store.put(draft.id, record)
        except RecordTooLarge as error:
            raise TooLarge(f"{error}; send store: false", "store") from None


# -- shapes ------------------------------------------------------------------------------


class _Draft:
    """The response object of one turn, from ``in_progress`` to its end."""

    def __init__(self, body: ResponsesRequest, turn: ChatTurn, stored: bool):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.stored = stored
        self._created = int(time.time())
        self._body, self._turn = body, turn
        self.items = body.items  # this turn's input

    def snapshot(self, status: str, output: list[ResponseOutputItem], **fields) -> Response:
        body, params = self._body, self._turn.params[0]
        text_format = body.text.format if body.text else None
        choice = body.tool_choice
        echoed = {
            "id": self.id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self._turn.served,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.stored,
            "temperature": params.temperature,
            "text": {"format": _dumped(text_format) or {"type": "text"}},
            "tool_choice": _dumped(choice) or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "top_p": params.top_p,
            "top_logprobs": body.top_logprobs,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
        }
        return Response(**{**echoed, **fields})

    def finished(self, answer: Answer, output: list[ResponseOutputItem]) -> Response:
        """The response once ``answer`` is whole: completed, or incomplete where the
        token budget cut it."""
        cut = answer.finish_reason == "length"
        for item in output:
            item.status = "incomplete" if cut else "completed"
        return self.snapshot(
            "incomplete" if cut else "completed",
            output,
            completed_at=None if cut else int(time.time()),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
            usage=_usage(answer),
        )

    def failed(self, error: APIError, output: list[ResponseOutputItem]) -> Response:
        code = error.code or ("server_error" if error.status >= 500 else "invalid_request")
        failure = ResponseError(code=code, message=error.message)
        return self.snapshot("failed", output, error=failure)


def _dumped(value):
    """A request's model as the response echoes it (a plain value as it is)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(by_alias=True, exclude_none=True)
    return value


def _usage(answer: Answer) -> ResponseUsage:
    prompt, completion, cached = answer.usage
    return ResponseUsage(
        input_tokens=prompt,
        input_tokens_details={"cached_tokens": cached},
        output_tokens=completion,
        output_tokens_details={"reasoning_tokens": 0},
        total_tokens=prompt + completion,
    )


def _text_part(text: str = "", log_probs: list | None = None) -> ResponseOutputText:
    """Output text; ``logprobs`` lists its tokens' where the request included them."""
    return ResponseOutputText(
        type="output_text", text=text, annotations=[], logprobs=log_probs or []
    )


def _message_item(text: str = "", log_probs: list | None = None) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=f"msg_{uuid.uuid4().hex}",
        type="message",
        status="in_progress",
        role="assistant",
        content=[_text_part(text, log_probs)],
    )


def _call_item(call_id: str, name: str, arguments: str = "") -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        id=f"fc_{uuid.uuid4().hex}",
        type="function_call",
        status="in_progress",
        call_id=call_id,
        name=name,
        arguments=arguments,
    )


def _output_items(answer: Answer) -> list[ResponseOutputItem]:
    """A whole answer's output: its text (where it wrote any, or called nothing), then
    its calls."""
    wrote = answer.content or not answer.calls
    text = [_message_item(answer.content, answer.log_probs)] if wrote else []
    return text + [_call_item(call.id, call.name, call.arguments) for call in answer.calls]


# -- streaming ---------------------------------------------------------------------------


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
        events = self._add(_message_item())
        part = _text_part()
        return events + [
            self._emit(ResponseContentPartAddedEvent, **self._at(), content_index=0, part=part)
        ]

    def call(self, call_id: str, name: str) -> list[str]:
        return self._add(_call_item(call_id, name))

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


async def _events(
    store: ResponseStore | None, draft: _Draft, events: AnswerStream, history: list[dict]
) -> AsyncIterator[str]:
    emit = _Emitter()
    output = _OpenItems(emit)
    yield emit(ResponseCreatedEvent, response=draft.snapshot("in_progress", []))
    yield emit(ResponseInProgressEvent, response=draft.snapshot("in_progress", []))
    try:
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


async def _end(
    store: ResponseStore | None, draft: _Draft, answer: Answer, output: _OpenItems, history, emit
) -> list[str]:
    """The last events: the open item closed (an answer with no text and no call gets
    one empty message) and the whole response, once stored."""
    frames = [] if output.items else output.open_message()
    output.last_log_probs(answer.log_probs)
    cut = answer.finish_reason == "length"
    frames += output.close("incomplete" if cut else "completed")
    response = draft.finished(answer, output.items)
    await _save(store, draft, response, history)
    kind = ResponseIncompleteEvent if cut else ResponseCompletedEvent
    return frames + [emit(kind, response=response)]


def _failure(draft: _Draft, error: APIError, output: _OpenItems, emit: _Emitter) -> list[str]:
    frames = output.close("incomplete")
    return frames + [emit(ResponseFailedEvent, response=draft.failed(error, output.items))]
