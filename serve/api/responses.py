"""OpenAI's response shapes (completions, chat, their stream chunks, usage) and SSE framing."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator

from serve.api.errors import APIError
from serve.generation import GenerationChunk


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def completion_choice(
    index: int, text: str, finish_reason: str | None, _stream: bool, logprobs: dict | None = None
) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    streaming: bool,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    """A chat choice (``message``) or stream chunk choice (``delta``); with tool calls,
    the message's content is null where the model wrote only calls, as OpenAI's is."""
    if streaming:
        body = {"content": text} if text else {}
        body |= {"tool_calls": tool_calls} if tool_calls else {}
    else:
        content = None if tool_calls and not text.strip() else text
        body = {"role": "assistant", "content": content}
        body |= {"tool_calls": tool_calls} if tool_calls else {}
    return {
        "index": index,
        "delta" if streaming else "message": body,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


# A position's alternatives as token texts: [(text, log probability)], most likely first.
Alternatives = list[tuple[str, float]]


def _entry(token: str, log_prob: float) -> dict:
    return {"token": token, "logprob": log_prob, "bytes": list(token.encode())}


def chat_logprobs(tokens: list[str], log_probs, alternatives: list[Alternatives]) -> dict:
    """Chat's ``logprobs``: each chosen token with its ``top_logprobs`` (empty lists when
    none were asked for)."""
    alternatives = alternatives or [[] for _ in tokens]
    content = [
        {**_entry(t, p), "top_logprobs": [_entry(a, q) for a, q in top]}
        for t, p, top in zip(tokens, log_probs, alternatives, strict=True)
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokens: list[str], log_probs, alternatives: list[Alternatives | None], offset: int
) -> dict:
    """Completions' ``logprobs``: each token with its offset in the choice's text, which
    starts at ``offset``, and its ``top_logprobs``: the alternatives and, as vLLM and
    OpenAI do, the chosen token (so ``logprobs: 0`` lists the chosen token alone). A
    prompt's first token has no log probability: None in both lists."""
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
    tops = [
        None if top is None else {**dict(top), token: p}
        for token, p, top in zip(tokens, log_probs, alternatives, strict=True)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": list(log_probs),
        "top_logprobs": tops,
        "text_offset": offsets if tokens else [],
    }


def usage(lasts: list[GenerationChunk]) -> dict:
    prompt = sum(last.num_input_tokens for last in lasts)
    completion = sum(last.num_output_tokens for last in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(last.num_cached_tokens for last in lasts)},
    }


async def merge(starts) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """Interleave several started streams (``(first chunk, rest)`` pairs) as
    ``(index, chunk)`` in arrival order; every stream is closed when this ends."""
    if len(starts) == 1:  # the common case, without a task and a queue per chunk
        first, rest = starts[0]
        try:
            yield 0, first
            async for chunk in rest:
                yield 0, chunk
        finally:
            await rest.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, first: GenerationChunk, rest) -> None:
        try:
            await queue.put((index, first))
            async for chunk in rest:
                await queue.put((index, chunk))
        except APIError as error:
            await queue.put((index, error))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, first, rest)) for i, (first, rest) in enumerate(starts)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield index, item
    finally:  # done, failed or the client left: every replica stream is closed
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, rest in starts:
            await rest.aclose()
