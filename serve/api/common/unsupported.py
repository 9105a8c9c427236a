"""Request fields OpenAI or vLLM define that this server refuses, each with the reason
the client reads in its 400 (any other unknown field: "Extra inputs are not permitted")."""

from __future__ import annotations

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
