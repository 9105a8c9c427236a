"""OpenAI's response shapes as pydantic models: completions and chat (whole answers and
stream chunks), their logprobs and usage, /v1/models' cards, the embeddings list; the
two endpoints that build them (:data:`CHAT`, :data:`COMPLETIONS`); a stream's chunks as
events (:class:`ChunkEvents`).

Every model goes on the wire through ``serve/api/common/sse.py``, dumped with
``exclude_unset``. That gives one rule for the keys clients expect: a field without a
default is always sent (``null`` when it is None, as every choice's ``logprobs`` and
``finish_reason`` are), a field with a default only when given (a chunk's ``usage``, a
delta's ``content`` and ``tool_calls``, an adapter card's ``parent``).

The models are built from this server's own values, one chunk per streamed token:
pydantic's validation (in Rust) costs less than ``model_construct`` (in Python), and
nested parts are given as dicts where that saves building a model per token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel

from serve.api.common.errors import APIError
from serve.api.common.sse import one_line, sse
from serve.generation import GenerationChunk

# -- tool calls (serve/api/common/tool_parsers.py writes them as dicts of these shapes) --


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None  # a call's first fragment only
    arguments: str


class ToolCallDelta(BaseModel):
    """A streamed call's fragment: the first names the call (id, type, name), the
    others carry pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


# -- logprobs and usage ----------------------------------------------------------------


class TokenLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int]  # the token's UTF-8 bytes (a token may hold part of a character)


class ChatTokenLogProb(TokenLogProb):
    top_logprobs: list[TokenLogProb]  # empty when none were asked for


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogProb]
    refusal: str | None


class CompletionLogProbs(BaseModel):
    """Token by token; a prompt's first token (echo) has no log probability: None."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # each token's offset in the choice's text


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # read from the engine's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, lasts: list[GenerationChunk]) -> Usage:
        """The count of the answers whose latest chunks (running totals) are ``lasts``."""
        prompt = sum(last.num_input_tokens for last in lasts)
        completion = sum(last.num_output_tokens for last in lasts)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details={"cached_tokens": sum(last.num_cached_tokens for last in lasts)},
        )


# -- completions -----------------------------------------------------------------------


class CompletionChoice(BaseModel):
    """A whole answer's choice and a stream chunk's alike."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None


class _Head(BaseModel):
    """What every response and stream chunk of one request shares (see ``Endpoint.head``)."""

    id: str
    created: int
    model: str


class Completion(_Head):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Head):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None  # with stream_options.include_usage: the last chunk's


# -- chat ------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None where the model wrote only calls, as OpenAI's is
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None
    finish_reason: str | None


class ChatDelta(BaseModel):
    """What a chunk adds to the message: a choice's first chunk holds the role and empty
    content, the others what is new (no ``content`` key when no text is)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogProbs | None
    finish_reason: str | None


class ChatCompletion(_Head):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Head):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # with stream_options.include_usage: the last chunk's


# -- models and embeddings -------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    # A LoRA adapter's base model (as vLLM lists adapters); absent for a model.
    parent: str | None = None
    root: str | None = None

    @classmethod
    def of(cls, model_id: str, parent: str | None = None) -> ModelCard:
        base = {"parent": parent, "root": parent} if parent is not None else {}
        return cls(id=model_id, object="model", created=0, owned_by="triton", **base)


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# -- the endpoints ---------------------------------------------------------------------

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

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs=None) -> BaseModel:
        """A whole answer's choice."""
        raise NotImplementedError

    def chunk_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs=None
    ) -> BaseModel:
        """A stream chunk's choice: what is new since the last."""
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

    def choice(self, index, text, finish_reason, logprobs=None) -> CompletionChoice:
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
    whose bytes it repeats (tests/unit/test_openai_wire.py checks that)."""

    def __init__(self, endpoint: Endpoint, head: dict[str, Any]):
        empty = sse(endpoint.chunk(head, []))  # 'data: {"id":...,"choices":[]}\n\n'
        self._opening = empty.removesuffix("]}\n\n")

    def __call__(self, choices: list[BaseModel], usage: Usage | None = None) -> str:
        shaped = ",".join([choice.model_dump_json(exclude_unset=True) for choice in choices])
        counted = "" if usage is None else f',"usage":{usage.model_dump_json(exclude_unset=True)}'
        return f"{self._opening}{one_line(shaped)}]{counted}}}\n\n"


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
