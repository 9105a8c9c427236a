"""What a generation is on its way through the application, whoever serves it.

``GenerateParams`` goes from the API to a model's replicas, ``GenerationChunk``s come
back, or a ``GenerationError``: plain classes (Ray pickles them) that neither the HTTP
layer (``api/``) nor an engine's host (``triton/``, the vLLM server) owns.
:func:`coalesce` is how a hop sends what is ready, paced by :class:`StreamPacing`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field


class GenerationError(RuntimeError):
    """The engine (behind Triton, or vLLM) refused or failed a request.

    ``kind`` tells the front door which answer the client gets:
    ``invalid`` (the request is wrong: 400), ``unavailable`` (the engine is full or
    the server is going away: 503, retry), ``internal`` (anything else: 500).
    """

    INVALID, UNAVAILABLE, INTERNAL = "invalid", "unavailable", "internal"

    def __init__(self, message: str, kind: str = INTERNAL):
        super().__init__(message)
        self.kind = kind

    @property
    def retryable(self) -> bool:
        return self.kind == self.UNAVAILABLE


@dataclass(frozen=True)
class GenerateParams:
    """One generation request, already validated by the API layer."""

    # The engine reads prompt_token_ids where set (a client's own, or a request resumed
    # on another replica), else this text; routers match the text (prefix-aware routing).
    prompt: str
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_tokens whatever the model's end token
    return_log_probs: bool = False  # the chosen tokens' log probabilities
    top_log_probs: int = 0  # with them, this many most likely alternatives per token
    prompt_log_probs: bool = False  # the prompt's tokens' too (completions' echo)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to its logit
    prompt_token_ids: tuple[int, ...] = ()  # a prompt the client tokenized itself
    # A request resumed on another replica (serve/migration.py): the last this-many
    # prompt_token_ids are the answer so far, continued as if never cut.
    resumed_tokens: int = 0
    # The engine admits lower first when full (vLLM's order); set only for a model whose
    # engine takes it (the API layer's Backend.takes_priority).
    priority: int = 0
    # Guided decoding (TensorRT-LLM's guide types, tritonllm.contract.GUIDE_TYPES): the
    # answer is held to this grammar ("json_schema" with a schema's text, "regex", ...).
    guide_type: str | None = None
    guide: str = ""
    guide_field: str = ""  # the request's field the guide came from (a refusal names it)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    variant: str | None = None  # a multiplexed pool's variant (its own Triton ensemble)
    adapter: str | None = None  # a LoRA adapter of the model (docs/lora.md)

    @property
    def greedy(self) -> bool:
        """TensorRT-LLM's rule, which the API's sampling defaults follow: greedy when
        none of temperature, top_k and top_p is set, or temperature is 0, or top_k 1."""
        unset = self.temperature is None and not self.top_k and not self.top_p
        return unset or self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class TopLogProbs:
    """One position's most likely tokens and their log probabilities, most likely first."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]


@dataclass(frozen=True)
class PromptLogProbs:
    """The prompt's tokens as the engine read them, with their log probabilities."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float | None, ...]  # None for the first token
    top_log_probs: tuple[TopLogProbs | None, ...] = ()  # None for the first token


@dataclass(frozen=True)
class GenerationChunk:
    """New text of one streamed response; the last one carries ``finish_reason``."""

    text: str
    num_input_tokens: int
    num_output_tokens: int
    cum_log_prob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" on the last chunk
    # The new tokens' ids (never the end token, which no text holds) and, with
    # ``return_log_probs``, each one's log probability. On the last chunk of an answer
    # the end token ended, its log probability follows theirs, one entry beyond
    # ``token_ids`` (:attr:`logs_end_token`), as vLLM's answer lists it.
    token_ids: tuple[int, ...] = ()
    token_log_probs: tuple[float, ...] = ()
    # With ``top_log_probs``: each logged token's alternatives, most likely first.
    top_log_probs: tuple[TopLogProbs, ...] = ()
    # With ``prompt_log_probs``, on the first chunk only: the prompt's ids, each one's
    # log probability (None for the first token: nothing comes before it) and its
    # alternatives.
    prompt: PromptLogProbs | None = None
    num_cached_tokens: int = 0  # prompt tokens read from the engine's prefix cache

    @property
    def logs_end_token(self) -> bool:
        """The end token ended the answer and its log probability is the last one."""
        return len(self.token_log_probs) > len(self.token_ids)

    def merged(self, later: GenerationChunk) -> GenerationChunk:
        """One chunk for this one and the ``later`` one of the same answer (OpenAI's
        stream deltas may hold several tokens); counts are totals: the later ones."""
        return GenerationChunk(
            text=self.text + later.text,
            num_input_tokens=later.num_input_tokens,
            num_output_tokens=later.num_output_tokens,
            cum_log_prob=later.cum_log_prob,
            finish_reason=later.finish_reason,
            token_ids=self.token_ids + later.token_ids,
            token_log_probs=self.token_log_probs + later.token_log_probs,
            top_log_probs=self.top_log_probs + later.top_log_probs,
            prompt=self.prompt or later.prompt,
            num_cached_tokens=max(self.num_cached_tokens, later.num_cached_tokens),
        )


@dataclass
class StreamPacing:
    """How often one replica's streams send a chunk.

    Every hop after the replica (an SSE event through the HTTP front to the client, or
    a Ray object to the ingress) costs CPU per message whatever it holds, and the
    replica's one event loop makes every message. Under load the replica's streams
    therefore share a budget of ``chunks_per_s``: each stream's chunks leave at most
    every ``live / chunks_per_s`` seconds (256 streams at 1,000 a second: every 256 ms),
    each holding all the tokens made meanwhile. A stream whose tokens come slower than
    that (few streams, or a slow engine) sends each one when it is ready, and the first
    chunk never waits. ``interval_ms`` is a floor under that interval (a throughput-first
    deployment's fixed stream interval). Ray Serve LLM batches its streams' output
    alike, every 50 ms at any load (``stream_batching_interval_ms``).
    """

    interval_ms: float = 0.0
    chunks_per_s: float = 0.0  # 0: no shared budget
    live: int = 0  # the streams this replica is sending now

    def interval_s(self) -> float:
        shared = self.live / self.chunks_per_s if self.chunks_per_s else 0.0
        return max(self.interval_ms / 1000, shared)


async def coalesce(
    chunks: AsyncIterable[GenerationChunk], pacing: StreamPacing | None = None
) -> AsyncIterator[GenerationChunk]:
    """``chunks`` as they come, but what arrives while the consumer is busy goes out as
    one merged chunk.

    Every hop of a token (a Ray object, a gRPC message, an SSE event) costs CPU per
    message whatever it holds, so a hop that falls behind catches up by sending fewer,
    larger messages: its per-token cost falls as load rises. Without ``pacing`` nothing
    waits for a batch: a chunk that finds the consumer ready goes out alone at once.
    With it, later chunks are held until its interval has passed since the previous one
    went out; the first one never waits.

    Closing this iterator closes ``chunks`` where it can be closed (an abandoned
    generation stops upstream).
    Written by hand: neither asyncio nor Ray Serve offers a merging channel.
    """
    pending: list[GenerationChunk] = []  # at most one: arrivals merge into it
    arrived = asyncio.Event()
    reader = asyncio.ensure_future(_read(chunks, pending, arrived))
    if pacing is not None:
        pacing.live += 1
    try:
        last_sent = 0.0
        while pending or not reader.done():
            await arrived.wait()
            interval_s = pacing.interval_s() if pacing is not None else 0.0
            if interval_s and last_sent and not reader.done():
                await _until(last_sent + interval_s, reader)
            arrived.clear()
            if pending:
                chunk = pending.pop()
                last_sent = time.monotonic()
                yield chunk
        reader.result()  # the source's own error, after what it sent
    finally:
        if pacing is not None:
            pacing.live -= 1
        if not reader.done():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


async def _read(chunks, pending: list[GenerationChunk], arrived: asyncio.Event) -> None:
    try:
        async for chunk in chunks:
            if pending:
                pending[0] = pending[0].merged(chunk)
            else:
                pending.append(chunk)
            arrived.set()
    finally:
        arrived.set()  # the end (or an error) wakes the consumer too
        if hasattr(chunks, "aclose"):
            await chunks.aclose()


async def _until(deadline: float, reader: asyncio.Future) -> None:
    """Sleep until ``deadline``, or until the source ends (the last chunk goes at once)."""
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.wait([reader], timeout=delay)
