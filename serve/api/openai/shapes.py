"""OpenAI's response shapes as pydantic models: completions and chat (whole answers and
stream chunks), their logprobs and usage, /v1/models' cards, the embeddings list; the
endpoints that build them are in endpoints.py.

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

from typing import Literal

from pydantic import BaseModel

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
