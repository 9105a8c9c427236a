"""The API's backend (:class:`serve.api.common.backend.Backend`) in either layout: what
the routes need from the application, over a :class:`Channel` to the engines.

Two channels exist: Serve's DeploymentHandles to each model's replicas, from the
ingress (``serve/deployments/ingress.py``, ``layout: ingress``), and the replica's own
Triton (``serve/deployments/direct.py``, ``layout: direct``). Everything else is one
code: the models' tokenizers and sampling defaults, API keys and tenants' limits, the
response store, the request metrics, and a stream's moves to another replica where the
channel allows them (``serve/migration.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve.adapters import AdapterCatalog
from serve.api.common.auth import app_keyring
from serve.api.common.backend import Embeddings
from serve.api.common.chat_template import render_chat_prompt
from serve.api.common.errors import APIError, InternalError, NotFound, Overloaded
from serve.api.common.fairness import FairQueue
from serve.api.common.limits import Buckets, MemoryBuckets, RedisBuckets
from serve.api.common.sampling import SamplingDefaults
from serve.api.common.token_texts import TokenTexts
from serve.api.http import create_app
from serve.api.openai.responses.store import ResponseStore
from serve.config import AppConfig, ModelConfig, RateLimitsConfig
from serve.deployments.response_store import open_response_store, redis_url
from serve.engines.facts import EngineFacts
from serve.engines.triton.facts import triton_facts
from serve.engines.vllm.facts import vllm_facts
from serve.generation import GenerateParams, GenerationChunk, GenerationError
from serve.metrics import MetricsPublisher, RequestMetrics, replica_labels
from serve.migration import CannotResume, Resumable
from tritonllm import tokenization

log = logging.getLogger("ray.serve")

# How long /health and /metrics wait for Serve's controller or the metrics collector
# (neither queues behind generation traffic; a miss means it is down or restarting).
CONTROL_TIMEOUT_S = 5.0

# After a move to another replica that was lost before sending anything, the next move
# waits this long times the moves so far (routers learn of a dead replica in that time).
MIGRATION_BACKOFF_S = 0.5


# How the engines word a prompt that does not fit the model's context (ours:
# tritonllm.engine.request; TensorRT-LLM's: "... exceeds maximum input length"; vLLM's:
# "... is longer than the maximum model length" / "maximum context length is").
CONTEXT_EXCEEDED = re.compile(
    r"exceeds the maximum sequence length|exceeds maximum input length"
    r"|longer than the maximum model length|maximum context length is"
)


class ReplicaLost(Overloaded):
    """The replica's Triton died (or the replica did): safe to retry elsewhere."""


def as_api_error(error: BaseException) -> APIError | None:
    """The client's answer for a failure behind the handle (None: not ours to map).

    A replica's exception crosses Ray as a RayTaskError whose text is the remote
    traceback (file paths, pid, node address, actor id): the client gets only the
    replica's own message, and the detail stays in the replica's log."""
    if isinstance(error, RayTaskError) and isinstance(error.cause, GenerationError):
        error = error.cause
    if isinstance(error, GenerationError):
        message = str(error)
        if error.kind == GenerationError.INVALID:
            if CONTEXT_EXCEEDED.search(message):
                return APIError(message, code="context_length_exceeded")
            return APIError(message)
        if error.kind == GenerationError.UNAVAILABLE:
            return ReplicaLost(message)
        return InternalError(message)
    if isinstance(error, BackPressureError):
        return Overloaded("the model's replicas are all busy and their queue is full; retry")
    if isinstance(error, (RayActorError, ActorUnavailableError)):
        return ReplicaLost("the replica serving this request died; retry")
    if isinstance(error, DeploymentUnavailableError):
        return Overloaded("the model's deployment is not available; retry")
    return None


class Channel(Protocol):
    """How requests reach a model's engines."""

    def stream(self, model: ModelConfig, params: GenerateParams) -> AsyncIterator[GenerationChunk]:
        """One engine's chunks for ``params``; its failures as the client's errors
        (:class:`serve.api.common.errors.APIError`; :class:`ReplicaLost` where the
        request may go on elsewhere). Closing it stops the engine's sequence."""

    def max_migrations(self, model: ModelConfig) -> int:
        """How many times a stream of ``model`` may move to another replica."""

    async def embed(self, model: ModelConfig, texts: list[str]) -> Embeddings:
        """One vector per text."""

    async def not_ready(self) -> dict[str, str]:
        """The configured models that cannot answer now, each with the reason."""


@dataclass(frozen=True)
class ServedModel:
    """What the API knows of one generating model, loaded once per process."""

    engine: EngineFacts
    token_texts: TokenTexts
    sampling: SamplingDefaults
    adapters: AdapterCatalog | None  # the adapter directory of a model with lora

    @classmethod
    def load(cls, model: ModelConfig, tokenizer=None) -> ServedModel:
        """``tokenizer``: the engine's, where this process has it loaded already."""
        facts = (vllm_facts if model.engine == "vllm" else triton_facts)(model, tokenizer)
        return cls(
            engine=facts,
            token_texts=TokenTexts(facts.tokenizer, facts.skips_special_tokens),
            sampling=SamplingDefaults.from_checkpoint(facts.checkpoint),
            adapters=AdapterCatalog(model.lora.adapters_url()) if model.lora else None,
        )


def load_served(config: AppConfig, tokenizers: dict | None = None) -> dict[str, ServedModel]:
    """Every generating model's, by id (``tokenizers``: those loaded already, by id)."""
    loaded = tokenizers or {}
    return {
        m.id: ServedModel.load(m, loaded.get(m.id)) for m in config.models if m.task == "generate"
    }


def open_buckets(config: RateLimitsConfig, seat_s: float) -> Buckets:
    """The store of the tenants' rate limits ``config`` names (serve/api/common/limits.py);
    ``seat_s``: the app's longest answer (a seat its replica never gave back lapses)."""
    if config.store == "redis":
        url = redis_url(config, section="rate_limits")
        return RedisBuckets(url, config.key_prefix, config.on_store_error == "open", seat_s)
    return MemoryBuckets()


class ApiBackend:
    """:class:`serve.api.common.backend.Backend` over a :class:`Channel`."""

    def __init__(
        self,
        config: AppConfig,
        channel: Channel,
        served: dict[str, ServedModel],
        *,
        metrics_collector=None,
        response_store=None,
        fair_seats: dict[str, int] | None = None,
        engine_metrics: Callable[[], Awaitable[str]] | None = None,
    ):
        """``served``: :func:`load_served`'s. ``metrics_collector``: the app's
        (a DeploymentHandle; None: no /metrics). ``response_store``: the
        DeploymentHandle of the app's memory store (``responses.store: memory``).
        ``fair_seats``: each model's seats in this process (serve.app.fair_seats).
        ``engine_metrics``: the Triton metrics this process publishes beside its own
        (layout: direct)."""
        self.config = config
        self.channel = channel
        self.served = served
        self.response_store: ResponseStore | None = open_response_store(
            config.responses, response_store
        )
        self.metrics = RequestMetrics()
        self.fair_queues = {
            model_id: FairQueue(
                seats,
                config.model(model_id).deployment.max_queued_requests,
                self.metrics.queue_wait(model_id),
            )
            for model_id, seats in (fair_seats or {}).items()
        }
        self.keyring = app_keyring(config.api_keys, [m.id for m in config.models])
        longest_s = max(m.drain_timeout_s() for m in config.models)
        self.buckets = open_buckets(config.rate_limits, longest_s)
        self.metrics_collector = metrics_collector
        self._engine_metrics = engine_metrics
        self._publisher = None
        if metrics_collector is not None:
            labels = replica_labels()
            self._publisher = MetricsPublisher(metrics_collector, self._published, labels)
            self._publisher.start()
        log.info("API keys %s", "not configured (open API)" if self.keyring.open else "required")

    def asgi_app(self):
        """The FastAPI app over this backend (Serve's ``__serve_build_asgi_app__``)."""
        return create_app(self, self.keyring, self._record_response, self.buckets)

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.stop()

    async def _published(self) -> str:
        """What this process publishes to the app's metrics collector."""
        engine = await self._engine_metrics() if self._engine_metrics else ""
        return self.metrics.text() + engine

    def _record_response(self, scope, status: int, seconds: float) -> None:
        # The route's template, not the raw path: unknown paths must not mint labels.
        route = getattr(scope.get("route"), "path", "unmatched")
        state = scope.get("state", {})
        tenant = getattr(state.get("caller"), "tenant", None)  # tenants: a configured few
        self.metrics.response(state.get("model", ""), route, status, seconds, tenant)

    # -- what the API knows of each model ---------------------------------------------

    def chat_prompt(
        self, model: ModelConfig, messages: list[dict], tools: list[dict] | None = None
    ) -> str:
        return render_chat_prompt(self.served[model.id].engine.tokenizer, messages, tools)

    def vocab_size(self, model: ModelConfig) -> int:
        return len(self.served[model.id].engine.tokenizer)

    def count_prompt_tokens(self, model: ModelConfig, prompt: str) -> int:
        engine = self.served[model.id].engine
        return len(tokenization.encode(engine.tokenizer, prompt, engine.adds_special_tokens))

    def token_texts(self, model: ModelConfig) -> TokenTexts:
        return self.served[model.id].token_texts

    def sampling_defaults(self, model: ModelConfig) -> SamplingDefaults:
        return self.served[model.id].sampling

    def takes_priority(self, model: ModelConfig) -> bool:
        return self.served[model.id].engine.takes_priority

    def serves_alternatives(self, model: ModelConfig) -> bool:
        # Top-k and prompt log probabilities: vLLM and the torch engine (an extension).
        return model.engine == "vllm" or self.served[model.id].engine.extensions

    def count_tenant_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        self.metrics.tenant_tokens.labels(tenant, "prompt").inc(prompt)
        self.metrics.tenant_tokens.labels(tenant, "completion").inc(completion)

    async def adapters(self, model: ModelConfig) -> list[str]:
        return sorted(await self._adapter_names(model))

    async def _adapter_names(self, model: ModelConfig) -> frozenset[str]:
        try:
            return await self.served[model.id].adapters.names()
        except OSError as error:
            log.warning("model %s: the adapter directory cannot be listed: %s", model.id, error)
            raise Overloaded(f"model {model.id!r}'s adapters cannot be listed now; retry") from None

    async def _require_adapter(self, model: ModelConfig, adapter: str) -> None:
        if adapter not in await self._adapter_names(model):
            raise NotFound(
                f"model {model.adapter_id(adapter)!r} does not exist: {model.id!r} has no "
                f"adapter {adapter!r}",
                param="model",
                code="model_not_found",
            )

    # -- generation ----------------------------------------------------------------------

    async def start(self, model: ModelConfig, params: GenerateParams):
        """The first chunk (a lost replica's request resumes elsewhere) and the rest."""
        if params.adapter is not None:
            await self._require_adapter(model, params.adapter)
        stream = self._stream(model, params)
        try:
            first = await stream.__anext__()
        except BaseException:
            await stream.aclose()
            raise
        return first, stream

    async def collect(self, model: ModelConfig, params: GenerateParams):
        if params.adapter is not None:
            await self._require_adapter(model, params.adapter)
        text, token_ids, log_probs, top = [], [], [], []
        prompt = None
        async for chunk in self._stream(model, params):
            text.append(chunk.text)
            token_ids += chunk.token_ids
            log_probs += chunk.token_log_probs
            top += chunk.top_log_probs
            prompt = prompt or chunk.prompt
        whole = {
            "token_ids": tuple(token_ids),
            "token_log_probs": tuple(log_probs),
            "top_log_probs": tuple(top),
            "prompt": prompt,
        }
        return "".join(text), dataclasses.replace(chunk, **whole)

    async def _stream(
        self, model: ModelConfig, params: GenerateParams
    ) -> AsyncIterator[GenerationChunk]:
        """The answer's chunks, with errors mapped and the latency figures recorded; a
        request whose replica is lost resumes on another one where it was cut
        (:mod:`serve.migration`), up to the channel's moves for the model."""
        metrics = self.metrics.model(params.variant or model.id)
        moves = self.channel.max_migrations(model)
        served = self.served[model.id]
        answer = Resumable(
            params,
            lambda: served.engine.tokenizer,
            moves,
            engine_resumes=served.engine.extensions,
        )
        metrics.started()
        clock = TextClock(metrics)
        attempt, chunk = params, None
        try:
            while True:
                try:
                    # aclosing: a client that goes away cancels the engine's call at once.
                    async with aclosing(self.channel.stream(model, attempt)) as chunks:
                        async for chunk in chunks:
                            chunk = answer.deliver(chunk)
                            clock.record(chunk)
                            yield chunk
                    return
                except ReplicaLost as error:
                    if answer.finished:  # lost after its last token: only the end is due
                        chunk = answer.final_chunk()
                        yield chunk
                        return
                    if not moves:  # migration off: the client's 503
                        raise
                    attempt = await _moved(answer, error, metrics)
                except APIError as error:
                    _name_the_guide(error, params)
                    raise
        finally:
            if chunk is not None:  # the prompt and what was generated, also if cancelled
                metrics.tokens(chunk.num_input_tokens, chunk.num_output_tokens)
            metrics.ended(had_text=clock.had_text)

    # -- embeddings, readiness, metrics ------------------------------------------------

    async def embed(self, model: ModelConfig, texts: list[str]) -> Embeddings:
        return await self.channel.embed(model, texts)

    async def not_ready(self) -> dict[str, str]:
        return await self.channel.not_ready()

    async def metrics_text(self) -> str:
        try:
            response = self.metrics_collector.render.remote()
            return await asyncio.wait_for(response, CONTROL_TIMEOUT_S)
        except Exception as error:
            log.warning("metrics: the collector did not answer: %s", error)
            raise Overloaded("the metrics collector is not available; retry") from None


class ServesTheApi:
    """A deployment whose HTTP app is its ``backend``'s (``@serve.ingress``)."""

    backend: ApiBackend

    def __serve_build_asgi_app__(self):
        return self.backend.asgi_app()

    def __del__(self):
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()
        parent = getattr(super(), "__del__", None)
        if parent is not None:  # a Triton replica's: Triton must not outlive it
            parent()


async def _moved(answer: Resumable, error: ReplicaLost, metrics) -> GenerateParams:
    """The request continuing ``answer`` on another replica; ``error`` (with why) when it
    may not."""
    try:
        resumed = answer.resume()
    except CannotResume as refusal:
        metrics.migration("refused")
        log.warning("request %s: %s; not resumed: %s", answer.params.request_id, error, refusal)
        raise ReplicaLost(f"{error.message}; {refusal}") from None
    metrics.migration("resumed")
    log.warning(
        "request %s: %s; resuming on another replica after %d tokens (move %d)",
        answer.params.request_id,
        error.message,
        answer.delivered,
        answer.migrations,
    )
    if answer.stalled:
        # The last move got nothing either: its replica was lost too (dying, or not yet
        # known dead to the routers). They get a moment to drop it.
        await asyncio.sleep(MIGRATION_BACKOFF_S * answer.migrations)
    return resumed


def _name_the_guide(error: APIError, params: GenerateParams) -> None:
    """The engine's refusal of a request's guide (past the compile limit, or not
    compilable) names the request's field the guide came from."""
    if params.guide_field and error.status == 400 and not error.param and "guide" in error.message:
        error.param = params.guide_field
        error.message = f"{params.guide_field}: {error.message}"


class TextClock:
    """A generation's time to first text and between texts, as its client sees them
    (a migration's gap included)."""

    def __init__(self, metrics):
        self._metrics = metrics
        self._last = time.monotonic()
        self.had_text = False

    def record(self, chunk: GenerationChunk) -> None:
        if not chunk.text:
            return
        now = time.monotonic()
        if self.had_text:
            self._metrics.next_text(now - self._last)
        else:
            self._metrics.first_text(now - self._last)
        self.had_text, self._last = True, now
