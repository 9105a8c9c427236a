"""How chat completions and completions build their answers: one endpoint object each
(:data:`CHAT`, :data:`COMPLETIONS`) that the routes share and never ask which it is,
a stream's chunks as SSE events (:class:`ChunkEvents`), and several choices' streams
merged (:func:`merge`). The models they build are in shapes.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from serve.api.common.answer import AnswerStream, Step
from serve.api.common.errors import APIError
from serve.api.common.sse import one_line, sse
from serve.api.openai.shapes import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogProbs,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    Usage,
)

# A position's alternatives as token texts: [(text, log probability)], most likely first.
Alternatives = list[tuple[str, float]]


class Endpoint:
    """One endpoint's answers (chat or completions): its ids, objects and choices; the
    routes hold one (:data:`CHAT`, :data:`COMPLETIONS`) and never ask which it is."""

    id_prefix: str
    text_offsets: bool = False  # whether its logprobs say where each token starts

    def head(self, model: str) -> dict[str, Any]:
        """The id, creation time and model every response and chunk of a request share."""
        return {
            "id": f"{self.id_prefix}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": model,
        }

    def choice(
        self, index: int, text: str, finish_reason: str | None, logprobs=None, tool_calls=None
    ) -> BaseModel:
        """A whole answer's choice (``tool_calls``: its calls as OpenAI's messages)."""
        raise NotImplementedError

    def chunk_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs=None, tool_calls=None
    ) -> BaseModel:
        """A stream chunk's choice: what is new since the last (``tool_calls``: the
        calls' pieces, as OpenAI's ``delta.tool_calls``)."""
        raise NotImplementedError

    def openings(self, count: int) -> list[BaseModel]:
        """The choices of the chunks a stream opens with, before any text."""
        raise NotImplementedError

    def logprobs(
        self, tokens: list[str], log_probs, alternatives, offsets: list[int] | None = None
    ) -> BaseModel:
        """``logprobs`` of ``tokens``, which start at ``offsets`` in the choice's text
        (given where ``text_offsets``)."""
        raise NotImplementedError

    def answer(self, head: dict[str, Any], choices: list, usage: Usage) -> BaseModel:
        """The whole response."""
        raise NotImplementedError

    def chunk(self, head: dict[str, Any], choices: list, usage: Usage | None = None) -> BaseModel:
        """A stream chunk (``usage``: the count so far, where the client asked for it)."""
        raise NotImplementedError


class CompletionsEndpoint(Endpoint):
    """/v1/completions: ``cmpl-`` ids, ``text_completion`` objects, whole and streamed."""

    id_prefix = "cmpl"
    text_offsets = True

    def choice(self, index, text, finish_reason, logprobs=None, tool_calls=None):
        """Completions read no tool calls: ``tool_calls`` is always empty here."""
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason
        )

    chunk_choice = choice  # a chunk's choice has the same shape

    def openings(self, count: int) -> list[CompletionChoice]:
        return []

    def logprobs(
        self,
        tokens: list[str],
        log_probs,
        alternatives: list[Alternatives | None],
        offsets: list[int] | None = None,
    ) -> CompletionLogProbs:
        """Each token with its offset and its ``top_logprobs``: the alternatives and, as
        vLLM and OpenAI do, the chosen token (so ``logprobs: 0`` lists the chosen token
        alone); None in both lists for a prompt's first token."""
        tops = [
            None if top is None else {**dict(top), token: p}
            for token, p, top in zip(tokens, log_probs, alternatives, strict=True)
        ]
        return CompletionLogProbs(
            tokens=tokens,
            token_logprobs=log_probs,
            top_logprobs=tops,
            text_offset=offsets,
        )

    def answer(self, head, choices, usage) -> Completion:
        return Completion(**head, object="text_completion", choices=choices, usage=usage)

    def chunk(self, head, choices, usage=None) -> CompletionChunk:
        return CompletionChunk(
            **head, object="text_completion", choices=choices, **_given(usage=usage)
        )


class ChatEndpoint(Endpoint):
    """/v1/chat/completions: ``chatcmpl-`` ids, ``chat.completion`` answers and
    ``chat.completion.chunk`` chunks; choices may carry tool calls."""

    id_prefix = "chatcmpl"

    def choice(
        self, index, text, finish_reason, logprobs=None, tool_calls: list[dict] | None = None
    ) -> ChatChoice:
        """With tool calls, content is null where the model wrote only calls."""
        content = None if tool_calls and not text.strip() else text
        message = ChatMessage(role="assistant", content=content, **_given(tool_calls=tool_calls))
        return ChatChoice(
            index=index, message=message, logprobs=logprobs, finish_reason=finish_reason
        )

    def chunk_choice(
        self, index, text, finish_reason, logprobs=None, tool_calls: list[dict] | None = None
    ) -> ChatChunkChoice:
        delta = {"content": text} if text else {}  # validated into a ChatDelta
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return ChatChunkChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
        )

    def openings(self, count: int) -> list[ChatChunkChoice]:
        """Every choice opens with the role, as OpenAI's streams do."""
        role = ChatDelta(role="assistant", content="")
        return [
            ChatChunkChoice(index=i, delta=role, logprobs=None, finish_reason=None)
            for i in range(count)
        ]

    def logprobs(
        self, tokens: list[str], log_probs, alternatives: list[Alternatives], _offsets=None
    ) -> ChatLogProbs:
        """Each chosen token with its ``top_logprobs``."""
        content = [
            {**_token(t, p), "top_logprobs": [_token(a, q) for a, q in top]}
            for t, p, top in zip(tokens, log_probs, alternatives, strict=True)
        ]
        return ChatLogProbs(content=content, refusal=None)

    def answer(self, head, choices, usage) -> ChatCompletion:
        return ChatCompletion(**head, object="chat.completion", choices=choices, usage=usage)

    def chunk(self, head, choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            **head, object="chat.completion.chunk", choices=choices, **_given(usage=usage)
        )


def _given(**fields) -> dict[str, Any]:
    """The fields that have something to say: OpenAI leaves out the empty ones."""
    return {name: value for name, value in fields.items() if value}


def _token(token: str, log_prob: float) -> dict:
    return {"token": token, "logprob": log_prob, "bytes": list(token.encode())}


CHAT = ChatEndpoint()
COMPLETIONS = CompletionsEndpoint()


# -- the wire --------------------------------------------------------------------------


class ChunkEvents:
    """The SSE events of one stream's chunks. Every chunk of a stream has the same id,
    time, model and object: they are serialized once, and each event serializes only its
    choices and usage: a token's event costs less than dumping the whole chunk model,
    whose bytes it repeats (tests/unit/serve/api/openai/test_openai_wire.py checks that)."""

    def __init__(self, endpoint: Endpoint, head: dict[str, Any]):
        empty = sse(endpoint.chunk(head, []))  # 'data: {"id":...,"choices":[]}\n\n'
        self._opening = empty.removesuffix("]}\n\n")

    def __call__(self, choices: list[BaseModel], usage: Usage | None = None) -> str:
        shaped = ",".join([choice.model_dump_json(exclude_unset=True) for choice in choices])
        counted = "" if usage is None else f',"usage":{usage.model_dump_json(exclude_unset=True)}'
        return f"{self._opening}{one_line(shaped)}]{counted}}}\n\n"


async def merge(streams: list[AnswerStream]) -> AsyncIterator[tuple[int, Step]]:
    """Interleave several choices' steps as ``(index, step)`` in arrival order; every
    stream is closed when this ends."""
    if len(streams) == 1:  # the common case, without a task and a queue per step
        stream = streams[0]
        try:
            async for step in stream:
                yield 0, step
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AnswerStream) -> None:
        try:
            async for step in stream:
                await queue.put((index, step))
        except APIError as error:
            await queue.put((index, error))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
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
        for stream in streams:
            await stream.aclose()
