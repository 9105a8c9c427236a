"""Request fields OpenAI or vLLM define that this server refuses, each with the reason
the client reads in its 400 (any other unknown field: "Extra inputs are not permitted")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_FUNCTIONS = "OpenAI's deprecated function calling: send tools and tool_choice instead"

_CHAT_ONLY = "tool calling is a chat feature: send tools to /v1/chat/completions"

REASONS = {
    "tools": _CHAT_ONLY,
    "tool_choice": _CHAT_ONLY,
    "parallel_tool_calls": _CHAT_ONLY,
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "min_p": "min-p sampling is not implemented in the engines here; use top_p or top_k",
    "stop_token_ids": "stop words reach the engines as text only; send the tokens' text in stop",
    "best_of": "beam and best-of search are not supported; use n",
    "use_beam_search": "beam and best-of search are not supported; use n",
    "suffix": "fill-in-the-middle needs a model and template for it",
    "audio": "the models here read and write text only",
    "modalities": "the models here read and write text only",
    "prediction": "predicted outputs (speculative decoding from a given text) are not supported",
}


def reason(field: str) -> str | None:
    """Why ``field`` (a body field's name) is refused, when it is a known one."""
    return REASONS.get(field)


def part_type(part: Any) -> str:
    """A content part's (or block's) type; a part that is no object, its Python type."""
    return part.get("type") if isinstance(part, dict) else type(part).__name__


def outsider(
    parts: Any, allowed: tuple[str, ...], type_of: Callable[[Any], str | None] = part_type
) -> tuple[int, str | None] | None:
    """The first of a list of parts, blocks or items whose type is not ``allowed``:
    (index, type); None where all are (or ``parts`` is no list). Schemas check it before
    pydantic tries a union of part models, so the client reads one error that names the
    part, rather than one per member of the union."""
    for i, part in enumerate(parts if isinstance(parts, list) else []):
        kind = type_of(part)
        if kind not in allowed:
            return i, kind
    return None
