"""The front door of ``layout: ingress``: the FastAPI app under ``@serve.ingress``, over
Serve's DeploymentHandles to each model's replicas (:class:`HandleChannel`).

Generation goes to each model's replicas through a streaming DeploymentHandle. When a
client disconnects, Starlette cancels the response task; closing the handle's
generator makes Serve cancel the replica's ``generate``, whose host then stops the
engine's sequence.

Failures of the replicas are turned into OpenAI errors here, the one place that holds
the handles: a request whose replica lost its Triton (or died) resumes on another
replica where it was cut (``serve/migration.py``, in the API backend), up to the
model's ``max_migrations`` times, else is answered 503 with ``Retry-After``; a full
deployment (``max_queued_requests``) is a 503 at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import numpy as np
from ray import serve

from serve.api.common.backend import Embeddings
from serve.config import AppConfig, ModelConfig
from serve.deployments.api_backend import (
    CONTROL_TIMEOUT_S,
    ApiBackend,
    ServesTheApi,
    as_api_error,
    load_served,
)
from serve.generation import GenerateParams, GenerationChunk, coalesce

log = logging.getLogger("ray.serve")


@serve.ingress()  # the app is built in the replica, by __serve_build_asgi_app__
class OpenAIIngress(ServesTheApi):
    """Routes each request by its ``model`` to that model's deployment."""

    async def __init__(
        self,
        replicas: dict,
        config: AppConfig,
        metrics_collector=None,
        response_store=None,
        fair_seats: dict[str, int] | None = None,
    ):
        """``replicas``: each model's DeploymentHandle, by id; ``fair_seats``: each
        model's seats in this replica (serve.app.fair_seats)."""
        self.backend = ApiBackend(
            config,
            HandleChannel(replicas, config),
            load_served(config),
            metrics_collector=metrics_collector,
            response_store=response_store,
            fair_seats=fair_seats,
        )


class HandleChannel:
    """:class:`serve.deployments.api_backend.Channel` over Serve's DeploymentHandles."""

    def __init__(self, replicas: dict, config: AppConfig):
        self.replicas = replicas  # model id -> DeploymentHandle of its replicas
        self.config = config

    def max_migrations(self, model: ModelConfig) -> int:
        return model.max_migrations

    async def stream(
        self, model: ModelConfig, params: GenerateParams
    ) -> AsyncIterator[GenerationChunk]:
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
            raise (as_api_error(error) or error) from None
        finally:
            if responses is not None and not finished:
                _cancel(responses)

    async def embed(self, model: ModelConfig, texts: list[str]) -> Embeddings:
        try:
            vectors, num_tokens = await self.replicas[model.id].embed.remote(texts)
        except Exception as error:
            raise (as_api_error(error) or error) from None
        return Embeddings(np.asarray(vectors, dtype=np.float32), int(num_tokens))

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


def _cancel(responses) -> None:
    """Cancel a handle call the caller abandoned (frees the engine through the replica).
    ``cancel()`` re-raises the call's own failure (a request refused by backpressure
    never reached a replica): there is nothing to cancel then."""
    try:
        responses.cancel()
    except Exception as error:
        log.debug("nothing to cancel: %s", error)


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
