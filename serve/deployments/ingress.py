"""The HTTP front door: the FastAPI app under ``@serve.ingress``, routing to Triton replicas.

Generation goes to each model's Triton replicas through a streaming
DeploymentHandle. When a client disconnects, Starlette cancels the response task;
closing the handle's generator makes Serve cancel the replica's ``generate``,
whose host then stops the engine's sequence.

Failures of the replicas are turned into OpenAI errors here, the one place that
holds the handles: a replica that lost its Triton (or died) is retried once for a
request that has sent nothing yet, else answered 503 with ``Retry-After``; a
full deployment (``max_queued_requests``) is a 503 at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import numpy as np
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve.api.auth import load_api_keys
from serve.api.backend import Embeddings
from serve.api.chat_template import render_chat_prompt
from serve.api.errors import APIError, InternalError, Overloaded
from serve.api.http import create_app
from serve.config import AppConfig, ModelConfig
from serve.generation import GenerateParams, GenerationChunk, coalesce
from serve.metrics import RequestMetrics
from serve.triton import repository
from serve.triton.host import GenerationError

log = logging.getLogger("ray.serve")

# How long /health waits for a model's replica to answer ``ready()``. A call queues
# behind a replica's max_ongoing_requests, so a saturated model may miss it: the
# probes' failure thresholds (docker/) allow for a few misses in a row.
READY_TIMEOUT_S = 5.0


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
    """The client's answer for a failure behind the handle (None: not ours to map)."""
    if isinstance(error, GenerationError):
        if error.kind == GenerationError.INVALID:
            return APIError(str(error))
        if error.kind == GenerationError.UNAVAILABLE:
            return ReplicaLost(str(error))
        return InternalError(str(error))
    if isinstance(error, BackPressureError):
        return Overloaded("the model's replicas are all busy and their queue is full; retry")
    if isinstance(error, (RayActorError, ActorUnavailableError)):
        return ReplicaLost("the replica serving this request died; retry")
    if isinstance(error, DeploymentUnavailableError):
        return Overloaded("the model's deployment is not available; retry")
    return None


def _tokenizer_dir(model: ModelConfig):
    """The tokenizer (and chat template) the model's engine itself uses."""
    if model.engine == "vllm":
        return model.vllm.checkpoint_path()
    return repository.tokenizer_dir(model.triton.repository_path())


@serve.ingress()  # the app is built in the replica, by __serve_build_asgi_app__
class OpenAIIngress:
    """Implements :class:`serve.api.backend.Backend` for the routes."""

    def __init__(self, replicas: dict, config: AppConfig):
        from tritonllm.tokenization import load_tokenizer

        self.replicas = replicas  # model id -> DeploymentHandle of its Triton replicas
        self.config = config
        self.metrics = RequestMetrics()
        self.tokenizers = {
            m.id: load_tokenizer(str(_tokenizer_dir(m)))
            for m in config.models
            if m.task == "generate"
        }
        self._api_keys = load_api_keys(config.api_keys.env, config.api_keys.file)
        log.info("API keys %s", "required" if self._api_keys else "not configured (open API)")

    def __serve_build_asgi_app__(self):
        return create_app(self, self._api_keys, self._record_response)

    def _record_response(self, scope, status: int, seconds: float) -> None:
        # The route's template, not the raw path: unknown paths must not mint labels.
        route = getattr(scope.get("route"), "path", "unmatched")
        self.metrics.response(scope.get("state", {}).get("model", ""), route, status, seconds)

    def chat_prompt(self, model: ModelConfig, messages: list[dict]) -> str:
        return render_chat_prompt(self.tokenizers[model.id], messages)

    # -- generation ----------------------------------------------------------------------

    async def start(self, model: ModelConfig, params: GenerateParams):
        """Peek the first chunk, retrying once on a lost replica (nothing was sent yet)."""
        return await self._retrying_once(self._peek, model, params)

    async def _peek(self, model: ModelConfig, params: GenerateParams):
        stream = self._stream(model, params)
        try:
            first = await stream.__anext__()
        except BaseException:
            await stream.aclose()
            raise
        return first, stream

    async def collect(self, model: ModelConfig, params: GenerateParams):
        return await self._retrying_once(self._collect, model, params)

    async def _retrying_once(self, attempt, model: ModelConfig, params: GenerateParams):
        """``attempt`` again on another replica if its replica was lost (the client has
        been sent nothing yet)."""
        try:
            return await attempt(model, params)
        except ReplicaLost as error:
            log.warning("request %s: %s; retrying once", params.request_id, error.message)
            return await attempt(model, params)

    async def _collect(self, model: ModelConfig, params: GenerateParams):
        text = []
        async for chunk in self._stream(model, params):
            text.append(chunk.text)
        return "".join(text), chunk

    async def _stream(
        self, model: ModelConfig, params: GenerateParams
    ) -> AsyncIterator[GenerationChunk]:
        """The replica's chunks, with errors mapped and the latency figures recorded."""
        # A variant goes to a replica that already holds it (Serve's multiplexing).
        handle = self.replicas[model.id].options(
            stream=True, multiplexed_model_id=params.variant or ""
        )
        label = params.variant or model.id
        responses = None
        start = last = time.monotonic()
        first, finished = True, False
        self.metrics.generation_started(label)
        try:
            responses = handle.generate.remote(params)
            # Chunks that Ray delivers while this replica is busy become one SSE event.
            async for chunk in coalesce(responses):
                now = time.monotonic()
                if chunk.text:
                    self.metrics.text_arrived(label, now - (start if first else last), first)
                    first, last = False, now
                if chunk.finish_reason:
                    self.metrics.tokens(label, chunk.num_input_tokens, chunk.num_output_tokens)
                yield chunk
            finished = True
        except Exception as error:
            raise _translate(error) from None
        finally:
            self.metrics.generation_ended(label)
            if responses is not None and not finished:
                _cancel(responses)

    # -- embeddings ----------------------------------------------------------------------

    async def embed(self, model: ModelConfig, texts: list[str]) -> Embeddings:
        try:
            vectors, num_tokens = await self.replicas[model.id].embed.remote(texts)
        except Exception as error:
            raise _translate(error) from None
        return Embeddings(np.asarray(vectors, dtype=np.float32), int(num_tokens))

    # -- readiness (GET /health) ---------------------------------------------------------

    async def not_ready(self) -> dict[str, str]:
        reasons = await asyncio.gather(*(self._not_ready(m) for m in self.config.models))
        return {m.id: r for m, r in zip(self.config.models, reasons, strict=True) if r}

    async def _not_ready(self, model: ModelConfig) -> str | None:
        """Why no replica of ``model`` can answer now (None: one whose Triton is ready did)."""
        response = self.replicas[model.id].ready.remote()
        try:
            ready = await asyncio.wait_for(response, READY_TIMEOUT_S)
        except BackPressureError:
            return None  # every replica is busy and the queue is full: serving, not down
        except asyncio.TimeoutError:
            _cancel(response)
            return f"no replica answered within {READY_TIMEOUT_S:.0f} s (starting, or all busy)"
        except (RayActorError, ActorUnavailableError, DeploymentUnavailableError) as error:
            log.info("readiness of %s: %s", model.id, error)
            return "no running replica"
        return None if ready else "Triton does not report the model ready"
