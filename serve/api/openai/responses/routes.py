"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A response is one chat turn on the path every chat-shaped API shares
(:func:`serve.api.openai.prepare.chat_turn`, :mod:`serve.api.common.answer`): its input
items become chat messages, its function tools and ``text.format`` the same guides as
chat's. With ``store`` (OpenAI's default) the response and its conversation go to the
operator's response store (:mod:`serve.api.openai.responses.store`), where
``previous_response_id`` finds them: the next turn's prompt is that conversation, then
the new input. What one API key stores only that key reads, chains from or deletes; to
any other it is the same 404 as an id never stored.
"""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import ValidationError

from serve.api.common.auth import key_owner, require_api_key
from serve.api.common.errors import APIError, NotFound
from serve.api.common.sse import EventStream, json_response
from serve.api.openai.log_probs import chat_entries
from serve.api.openai.prepare import BackendDep, chat_turn, guided
from serve.api.openai.responses.draft import Draft, output_items, save
from serve.api.openai.responses.input_items import input_items, page, with_ids
from serve.api.openai.responses.schemas import (
    ResponsesRequest,
    dump_items,
)
from serve.api.openai.responses.store import OwnedStore, ResponseStore
from serve.api.openai.responses.stream import response_events
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
        log_probs = chat_entries(backend, turn.model, turn.params[0])
        if body.stream:
            started = await turn.start_answer(backend)
        else:
            started = await turn.whole_answer(backend, log_probs)
    except APIError as error:  # named as this API names the field
        error.param = _renamed(error.param)
        raise
    draft = Draft(body, turn, stored=body.store and store is not None)
    history = conversation + with_ids(dump_items(body.items))
    if not body.stream:
        response = draft.finished(started, output_items(started))
        await save(store, draft, response, history)
        return json_response(response)
    return EventStream(response_events(store, draft, started, history, log_probs))


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
