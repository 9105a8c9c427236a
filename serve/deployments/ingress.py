"""The HTTP front door: the FastAPI app under ``@serve.ingress``, routing to Triton replicas
(``ApiBackend``, the API's side of it, also serves ``layout: direct``: direct.py).

Generation goes to each model's Triton replicas through a streaming
DeploymentHandle. When a client disconnects, Starlette cancels the response task;
closing the handle's generator makes Serve cancel the replica's ``generate``,
whose host then stops the engine's sequence.

Failures of the replicas are turned into OpenAI errors here, the one place that
holds the handles: a request whose replica lost its Triton (or died) resumes on
another replica where it was cut (``serve/migration.py``), up to the model's
``max_migrations`` times, else is answered 503 with ``Retry-After``; a full
deployment (``max_queued_requests``) is a 503 at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np
from ray import serve
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
from serve.engines.triton import repository
from serve.generation import GenerateParams, GenerationChunk, GenerationError, coalesce
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


def _cancel(responses) -> None:
    """Cancel a handle call the caller abandoned (frees the engine through the replica).
    ``cancel()`` re-raises the call's own failure (a request refused by backpressure
    never reached a replica): there is nothing to cancel then."""
    try:
        responses.cancel()
    except Exception as error:
        log.debug("nothing to cancel: %s", error)


def _translate(error: Exception) -> Exception:
    return as_api_error(error) or error


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


def _name_the_guide(error: APIError, params: GenerateParams) -> None:
    """The engine's refusal of a request's guide (past the compile limit, or not
    compilable) names the request's field the guide came from."""
    if params.guide_field and error.status == 400 and not error.param and "guide" in error.message:
        error.param = params.guide_field
        error.message = f"{params.guide_field}: {error.message}"


def _tokenizer_dir(model: ModelConfig):
    """The tokenizer (and chat template) the model's engine itself uses."""
    if model.engine == "vllm":
        return model.vllm.checkpoint_path()
    return repository.tokenizer_dir(model.triton.repository_path())


def _load_tokenizer(model: ModelConfig):
    """The tokenizer the model's engine itself uses, loaded as it loads it."""
    if model.engine == "vllm":
        return tokenization.load_tokenizer(str(model.vllm.checkpoint_path()))
    return repository.load_tokenizer(model.triton.repository_path())


def _skips_special_tokens(model: ModelConfig) -> bool:
    """Whether the model's answers leave special tokens out of their text: the
    postprocessing's parameter, vLLM's default."""
    if model.engine == "vllm":
        return True
    return repository.skips_special_tokens(model.triton.repository_path())


def _adds_special_tokens(model: ModelConfig) -> bool:
    """Whether the model's engine encodes a prompt with its tokenizer's special tokens
    (BOS): the preprocessing's parameter, vLLM's default."""
    if model.engine == "vllm":
        return True
    return repository.adds_special_tokens(model.triton.repository_path())


def _serves_engine_extensions(model: ModelConfig) -> bool:
    """Whether the model's engine takes the contract's extensions (the torch engine, not
    TensorRT-LLM's backends nor vLLM)."""
    if model.engine == "vllm":
        return False
    repo = model.triton.repository_path()
    return repository.serves_engine_extensions(repo, model.engine_model())


def _takes_priority(model: ModelConfig) -> bool:
    """Whether the model's engine admits by priority (the torch engine; vLLM is deployed
    without its priority scheduling)."""
    if model.engine == "vllm":
        return False
    return repository.takes_priority(model.triton.repository_path(), model.engine_model())


def open_buckets(config: RateLimitsConfig, seat_s: float) -> Buckets:
    """The store of the tenants' rate limits ``config`` names (serve/api/common/limits.py);
    ``seat_s``: the app's longest answer (a seat its replica never gave back lapses)."""
    if config.store == "redis":
        url = redis_url(config, section="rate_limits")
        return RedisBuckets(url, config.key_prefix, config.on_store_error == "open", seat_s)
    return MemoryBuckets()


class ApiBackend:
    """:class:`serve.api.common.backend.Backend` for the routes, all but how a request reaches a
    Triton: over Serve's DeploymentHandles (:class:`OpenAIIngress`), or to the Triton
    the replica itself owns (``serve/deployments/direct.py``, ``layout: direct``)."""

    def _start_api(
        self, config: AppConfig, metrics_collector=None, response_store=None, tokenizers=None
    ) -> None:
        """``tokenizers``: those this process has loaded already, by model id."""
        self.config = config
        self.fair_queues = {}  # OpenAIIngress's, where fair shares are on
        # response_store: the DeploymentHandle of the app's memory store (store: memory).
        self.response_store: ResponseStore | None = open_response_store(
            config.responses, response_store
        )
        self.metrics = RequestMetrics()
        self.metrics_collector = metrics_collector  # DeploymentHandle (None: no /metrics)
        self._publisher = None
        if metrics_collector is not None:
            labels = replica_labels()
            self._publisher = MetricsPublisher(metrics_collector, self._metrics_text, labels)
            self._publisher.start()
        generating = [m for m in config.models if m.task == "generate"]
        checkpoints = {m.id: _tokenizer_dir(m) for m in generating}
        loaded = tokenizers or {}
        self.tokenizers = {m.id: loaded.get(m.id) or _load_tokenizer(m) for m in generating}
        self._token_texts = {
            m.id: TokenTexts(self.tokenizers[m.id], _skips_special_tokens(m))
            for m in config.models
            if m.task == "generate"
        }
        self._sampling = {i: SamplingDefaults.from_checkpoint(d) for i, d in checkpoints.items()}
        self._adds_special = {m.id: _adds_special_tokens(m) for m in generating}
        self._extensions = {
            m.id: _serves_engine_extensions(m) for m in config.models if m.task == "generate"
        }
        self._priorities = {m.id: _takes_priority(m) for m in config.models if m.task == "generate"}
        # Each LoRA model's adapter directory, listed at most every few seconds.
        self._adapters = {
            m.id: AdapterCatalog(m.lora.adapters_url()) for m in config.models if m.lora
        }
        self._keyring = app_keyring(config.api_keys, [m.id for m in config.models])
        longest_s = max(m.drain_timeout_s() for m in config.models)
        self._buckets = open_buckets(config.rate_limits, longest_s)
        log.info("API keys %s", "not configured (open API)" if self._keyring.open else "required")

    async def _metrics_text(self) -> str:
        """What this process publishes to the app's metrics collector."""
        return self.metrics.text()

    def __serve_build_asgi_app__(self):
        return create_app(self, self._keyring, self._record_response, self._buckets)

    def _record_response(self, scope, status: int, seconds: float) -> None:
        # The route's template, not the raw path: unknown paths must not mint labels.
        route = getattr(scope.get("route"), "path", "unmatched")
        state = scope.get("state", {})
        tenant = getattr(state.get("caller"), "tenant", None)  # tenants: a configured few
        self.metrics.response(state.get("model", ""), route, status, seconds, tenant)

    def count_tenant_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        self.metrics.tenant_tokens.labels(tenant, "prompt").inc(prompt)
        self.metrics.tenant_tokens.labels(tenant, "completion").inc(completion)

    def chat_prompt(
        self, model: ModelConfig, messages: list[dict], tools: list[dict] | None = None
    ) -> str:
        return render_chat_prompt(self.tokenizers[model.id], messages, tools)

    def vocab_size(self, model: ModelConfig) -> int:
        return len(self.tokenizers[model.id])

    def count_prompt_tokens(self, model: ModelConfig, prompt: str) -> int:
        tokenizer, adds_special = self.tokenizers[model.id], self._adds_special[model.id]
        return len(tokenization.encode(tokenizer, prompt, adds_special))

    def token_texts(self, model: ModelConfig) -> TokenTexts:
        return self._token_texts[model.id]

    def sampling_defaults(self, model: ModelConfig) -> SamplingDefaults:
        return self._sampling[model.id]

    def takes_priority(self, model: ModelConfig) -> bool:
        return self._priorities[model.id]

    def serves_alternatives(self, model: ModelConfig) -> bool:
        # Top-k and prompt log probabilities: vLLM and the torch engine (an extension).
        return model.engine == "vllm" or self._extensions[model.id]

    async def adapters(self, model: ModelConfig) -> list[str]:
        return sorted(await self._adapter_names(model))

    async def _adapter_names(self, model: ModelConfig) -> frozenset[str]:
        try:
            return await self._adapters[model.id].names()
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
        (:mod:`serve.migration`), up to the model's ``max_migrations`` times."""
        metrics = self.metrics.model(params.variant or model.id)
        answer = Resumable(
            params,
            lambda: self.tokenizers[model.id],
            self._max_migrations(model),
            engine_resumes=self._extensions.get(model.id, False),
        )
        metrics.started()
        clock = TextClock(metrics)
        attempt, chunk = params, None
        try:
            while True:
                try:
                    # aclosing: a client that goes away cancels the replica's call at once.
                    async with aclosing(self._attempt(model, attempt)) as chunks:
                        async for chunk in chunks:
                            chunk = answer.deliver(chunk)
                            clock.saw(chunk)
                            yield chunk
                    return
                except ReplicaLost as error:
                    if answer.finished:  # lost after its last token: only the end is due
                        chunk = answer.final_chunk()
                        yield chunk
                        return
                    if not self._max_migrations(model):  # migration off: the client's 503
                        raise
                    attempt = await self._moved(answer, error, metrics)
                except APIError as error:
                    _name_the_guide(error, params)
                    raise
        finally:
            if chunk is not None:  # the prompt and what was generated, also if cancelled
                metrics.tokens(chunk.num_input_tokens, chunk.num_output_tokens)
            metrics.ended(had_text=clock.had_text)

    def _max_migrations(self, model: ModelConfig) -> int:
        """How many times a request may move to another replica."""
        return model.max_migrations

    def _attempt(
        self, model: ModelConfig, params: GenerateParams
    ) -> AsyncIterator[GenerationChunk]:
        """One replica's chunks for ``params``, its failures as the client's errors."""
        raise NotImplementedError

    @staticmethod
    async def _moved(answer: Resumable, error: ReplicaLost, metrics) -> GenerateParams:
        """The request continuing ``answer`` on another replica; ``error`` (with why)
        when it may not."""
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
            # The last move got nothing either: its replica was lost too (dying, or
            # not yet known dead to the routers). They get a moment to drop it.
            await asyncio.sleep(MIGRATION_BACKOFF_S * answer.migrations)
        return resumed

    async def metrics_text(self) -> str:
        try:
            response = self.metrics_collector.render.remote()
            return await asyncio.wait_for(response, CONTROL_TIMEOUT_S)
        except Exception as error:
            log.warning("metrics: the collector did not answer: %s", error)
            raise Overloaded("the metrics collector is not available; retry") from None

    def __del__(self):
        if self._publisher is not None:
            self._publisher.stop()


@serve.ingress()  # the app is built in the replica, by __serve_build_asgi_app__
class OpenAIIngress(ApiBackend):
    """The front door of ``layout: ingress``: routes each request by its ``model`` to
    that model's deployment, over a streaming DeploymentHandle."""

    async def __init__(
        self,
        replicas: dict,
        config: AppConfig,
        metrics_collector=None,
        response_store=None,
        fair_seats: dict[str, int] | None = None,
    ):
        """``fair_seats``: each model's seats in this replica (serve.app.fair_seats)."""
        self.replicas = replicas  # model id -> DeploymentHandle of its Triton replicas
        self._start_api(config, metrics_collector, response_store)
        self.fair_queues = {
            model_id: FairQueue(
                seats,
                config.model(model_id).deployment.max_queued_requests,
                self.metrics.queue_wait(model_id),
            )
            for model_id, seats in (fair_seats or {}).items()
        }

    async def _attempt(
        self, model: ModelConfig, params: GenerateParams
    ) -> AsyncIterator[GenerationChunk]:
        """One replica's chunks for ``params``, its failures as the client's errors."""
        # A variant or an adapter goes to a replica that already holds it (Serve's
        # multiplexing).
        adapter = params.adapter and model.adapter_id(params.adapter)
        handle = self.replicas[model.id].options(
            stream=True, multiplexed_model_id=adapter or params.variant or ""
        )
        responses = None
        finished = False
        try:
            responses = handle.generate.remote(params)
            # Chunks that Ray delivers while this replica is busy become one SSE event.
            async for chunk in coalesce(responses):
                yield chunk
            finished = True
        except Exception as error:
            raise _translate(error) from None
        finally:
            if responses is not None and not finished:
                _cancel(responses)

    # -- embeddings ----------------------------------------------------------------------

    async def embed(self, model: ModelConfig, texts: list[str]) -> Embeddings:
        try:
            vectors, num_tokens = await self.replicas[model.id].embed.remote(texts)
        except Exception as error:
            raise _translate(error) from None
        return Embeddings(np.asarray(vectors, dtype=np.float32), int(num_tokens))

    # -- readiness (GET /health) and metrics (GET /metrics) ------------------------------

    async def not_ready(self) -> dict[str, str]:
        """From Serve's own replica states (the controller's view), not by calling the
        replicas: a call would queue behind a saturated replica's generations. A replica
        is RUNNING once its ``__init__`` returned, which is after its Triton reported
        the model ready, and stops being so when ``check_health`` (which asks Triton)
        has failed Serve's threshold of times in a row (3, every
        ``health_check_period_s``): then Serve replaces it."""
        try:
            # serve.status() blocks on the controller: off the event loop.
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), CONTROL_TIMEOUT_S)
        except Exception as error:
            log.warning("readiness: Serve's status is not available: %s", error)
            return {m.id: "Serve's controller did not answer" for m in self.config.models}
        reasons = {m.id: not_running(status, self.replicas[m.id]) for m in self.config.models}
        return {model: reason for model, reason in reasons.items() if reason}


class TextClock:
    """A generation's time to first text and between texts, as its client sees them
    (a migration's gap included)."""

    def __init__(self, metrics):
        self._metrics = metrics
        self._last = time.monotonic()
        self.had_text = False

    def saw(self, chunk: GenerationChunk) -> None:
        if not chunk.text:
            return
        now = time.monotonic()
        if self.had_text:
            self._metrics.next_text(now - self._last)
        else:
            self._metrics.first_text(now - self._last)
        self.had_text, self._last = True, now


def not_running(status, handle) -> str | None:
    """Why the deployment behind ``handle`` has no RUNNING replica in ``status`` (a
    ``serve.status()``), or None when it has one."""
    app = status.applications.get(handle.app_name)
    deployment = app.deployments.get(handle.deployment_name) if app else None
    if deployment is None:
        return "no deployment"
    states = deployment.replica_states
    if states.get("RUNNING"):
        return None
    replicas = ", ".join(f"{state}: {count}" for state, count in sorted(states.items()))
    return f"no running replica ({replicas or 'none'})"
