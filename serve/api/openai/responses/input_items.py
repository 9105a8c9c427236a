"""A stored response's input items, as ``GET /v1/responses/{id}/input_items`` lists
them: each with its id (given when the response was created, where the client sent
none) and its status, a message's text as content parts, a page at a time.
"""

from __future__ import annotations

import uuid
from typing import Literal

from serve.api.common.errors import APIError

# The id prefix of each kind of item the Responses API takes as input.
_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def with_ids(items: list[dict]) -> list[dict]:
    """Dumped input items, each with an id: the client's own, else a new one."""
    return [
        item if item.get("id") else {"id": f"{_PREFIXES[item['type']]}_{uuid.uuid4().hex}", **item}
        for item in items
    ]


def input_items(record: dict) -> list[dict]:
    """The items a stored response was created with, in the order sent: its
    conversation's last items before the response's own output."""
    conversation = record["conversation"]
    end = len(conversation) - len(record["response"]["output"])
    start = end - record.get("input_count", end)  # stored before the count: all before
    return [_listed(item) for item in conversation[start:end]]


def page(items: list[dict], after: str | None, limit: int, order: Literal["asc", "desc"]) -> dict:
    """One page of ``items`` (OpenAI's list object): ``limit`` of them, in ``order``
    (``desc``: the last sent first), after the item whose id is ``after``."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(f"after: no input item of this response has id {after!r}", "after")
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }


def _listed(item: dict) -> dict:
    """An item as the list shows it: with a status, and a message's text as a part."""
    listed = {"status": "completed", **item}
    if item["type"] == "message" and isinstance(item["content"], str):
        kind = "output_text" if item["role"] == "assistant" else "input_text"
        listed["content"] = [{"type": kind, "text": item["content"]}]
    listed.pop("phase", None)
    return listed
