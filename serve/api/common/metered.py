"""The app's backend as one request sees it: :class:`MeteredBackend` holds a tenant's
tokens per minute, :class:`SeatedBackend` its fair share of a model's engines
(serve/api/common/fairness.py).

A tenant's tokens per minute are held around each engine request, as OpenAI counts its
own: a request takes what it may use from the tenant's bucket before an engine sees it
(its prompt and its ``max_tokens``: a 429 when the bucket does not hold that much), and
once it has ended what it did use (the engine's own counts, prompt and answer) settles
the difference. So a tenant that asks for more than it uses waits only while its
requests run, and its minute's tokens are the engines' figures.

A text prompt is not tokenized for this (the engine tokenizes it; a second tokenization
here would cost the event loop every request): it counts ``CHARS_PER_TOKEN`` characters
a token until the engine's count settles it. A prompt of token ids counts its ids.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from serve.api.common.backend import Backend, Embeddings
from serve.api.common.fairness import Seat
from serve.api.common.keyring import Caller
from serve.api.common.limits import Buckets, RateLimited, in_background
from serve.api.common.middleware import on_answer_end
from serve.config import ModelConfig
from serve.generation import GenerateParams, GenerationChunk

# OpenAI's rule of thumb for English text; what is over or under is settled at the end.
CHARS_PER_TOKEN = 4


def prompt_tokens(params: GenerateParams) -> int:
    if params.prompt_token_ids:
        return len(params.prompt_token_ids)
    return math.ceil(len(params.prompt) / CHARS_PER_TOKEN)


class MeteredBackend:
    """The app's backend as one keyed request sees it: its generations and embeddings
    counted for its tenant (``tritonllm_tenant_tokens_total``) and, where the tenant has
    ``tokens_per_minute``, taken from its bucket and settled; the rest is the app's
    backend's."""

    def __init__(self, backend: Backend, request: Request, tenant: Caller, buckets: Buckets):
        self._backend, self._request, self._buckets = backend, request, buckets
        self._tenant = tenant.tenant
        self._per_minute = tenant.tokens_per_minute  # None: counted, not limited
        self._bucket = f"{tenant.tenant}:tokens"

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    async def start(
        self, model: ModelConfig, params: GenerateParams
    ) -> tuple[GenerationChunk, AsyncIterator[GenerationChunk]]:
        reserved = await self._reserve(prompt_tokens(params) + params.max_tokens)
        try:
            first, rest = await self._backend.start(model, params)
        except BaseException:
            self._ended(reserved, 0, 0)
            raise
        return first, self._settled(first, rest, reserved)

    async def collect(
        self, model: ModelConfig, params: GenerateParams
    ) -> tuple[str, GenerationChunk]:
        reserved = await self._reserve(prompt_tokens(params) + params.max_tokens)
        last = None
        try:
            text, last = await self._backend.collect(model, params)
        finally:
            self._ended_with(reserved, last)
        return text, last

    async def embed(self, model: ModelConfig, texts: list[str]) -> Embeddings:
        reserved = await self._reserve(sum(math.ceil(len(t) / CHARS_PER_TOKEN) for t in texts))
        result = None
        try:
            result = await self._backend.embed(model, texts)
        finally:
            self._ended(reserved, result.num_tokens if result is not None else 0, 0)
        return result

    async def _reserve(self, tokens: int) -> int:
        """Takes ``tokens`` from the tenant's bucket (0 where it has none): a 429 where
        they are not there."""
        if self._per_minute is None:
            return 0
        quota = await self._buckets.take(self._bucket, self._per_minute, tokens, "tokens")
        state = self._request.state
        others = [q for q in getattr(state, "quotas", ()) if q.kind != "tokens"]
        state.quotas = [*others, quota]  # the answer's x-ratelimit-*-tokens headers
        if not quota.allowed:
            raise RateLimited(self._tenant, quota, wanted=tokens)
        return tokens

    async def _settled(
        self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk], reserved: int
    ) -> AsyncIterator[GenerationChunk]:
        last = first
        try:
            async with aclosing(rest):
                async for chunk in rest:
                    last = chunk
                    yield chunk
        finally:  # also when the client went away: what was generated counts
            self._ended_with(reserved, last)

    def _ended_with(self, reserved: int, last: GenerationChunk | None) -> None:
        if last is None:
            self._ended(reserved, 0, 0)
        else:
            self._ended(reserved, last.num_input_tokens, last.num_output_tokens)

    def _ended(self, reserved: int, prompt: int, completion: int) -> None:
        """Counts what was used and, off the answer's path, takes what was used past the
        reservation or gives back what was not."""
        self._backend.count_tenant_tokens(self._tenant, prompt, completion)
        used = prompt + completion
        if self._per_minute is not None and used != reserved:
            in_background(self._buckets.settle(self._bucket, self._per_minute, used - reserved))


class SeatedBackend:
    """The app's backend as one request sees it with fair shares on: its first
    generation waits for a seat of its model's :class:`FairQueue` (models without one,
    embeddings', go at once), which the request holds until its answer has ended; the
    rest is the app's backend's. Nothing is added per token: the seat is given back by
    serve.api.common.middleware.RequestRecorder, not by a wrapper of the stream."""

    def __init__(self, backend: Backend, request: Request, caller: Caller):
        self._backend, self._request, self._caller = backend, request, caller
        self._seat: Seat | None = None
        self._seating = asyncio.Lock()  # a request's choices may start together

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    async def start(
        self, model: ModelConfig, params: GenerateParams
    ) -> tuple[GenerationChunk, AsyncIterator[GenerationChunk]]:
        await self._seated(model, params)
        return await self._backend.start(model, params)

    async def collect(
        self, model: ModelConfig, params: GenerateParams
    ) -> tuple[str, GenerationChunk]:
        await self._seated(model, params)
        return await self._backend.collect(model, params)

    async def _seated(self, model: ModelConfig, params: GenerateParams) -> None:
        queue = self._backend.fair_queues.get(model.id)
        if queue is None:
            return
        cost = prompt_tokens(params) + params.max_tokens
        async with self._seating:
            if self._seat is None:
                caller = self._caller
                priority = caller.priority_of(params.priority)
                self._seat = await queue.seat(caller.tenant, caller.weight, priority, cost)
                on_answer_end(self._request, self._seat.give_back)
                return
        self._seat.widen(cost)
