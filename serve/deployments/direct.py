"""``layout: direct``: the replica that owns Triton serves the OpenAI API itself.

With an ingress in front, every streamed chunk crosses one more process (the Triton
replica's generator to the ingress replica) before HAProxy. An app of one model that
needs no routing by ``model``, variant, adapter or prefix has no use for that hop:
here each replica is a Triton replica and the app's ingress, HAProxy (Ray Serve's
direct ingress) sends it the HTTP request, and it streams from its own Triton
(:class:`TritonChannel`). The routes, errors, API keys, limits and metrics are the
ingress's own (:class:`serve.deployments.api_backend.ApiBackend`). What the layout
gives up: a replica lost mid-answer takes its streams with it (with an ingress they
resume on another replica, serve/migration.py); the config says so
(docs/architecture.md#layouts).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from ray import serve

from serve.api.common.backend import Embeddings
from serve.api.common.errors import NotFound
from serve.config import AppConfig, ModelConfig
from serve.deployments.api_backend import ApiBackend, ServesTheApi, as_api_error, load_served
from serve.engines.triton.replica import TritonReplica
from serve.generation import GenerateParams, GenerationChunk


@serve.ingress()  # the app is built in the replica, by __serve_build_asgi_app__
class DirectReplica(ServesTheApi, TritonReplica):
    """A Triton replica that answers the OpenAI API itself (``layout: direct``)."""

    async def __init__(
        self, model: ModelConfig, config: AppConfig, metrics_collector=None, response_store=None
    ):
        await super().__init__(model, answers_http=True)
        # The API's tokenizer (chat template, token texts) is the replica's own: one
        # load. This process publishes its Triton's figures with the API's.
        self.backend = ApiBackend(
            config,
            TritonChannel(self),
            load_served(config, {model.id: self.tokenizer}),
            metrics_collector=metrics_collector,
            response_store=response_store,
            engine_metrics=self.host.metrics,
        )


class TritonChannel:
    """:class:`serve.deployments.api_backend.Channel` to the replica's own Triton."""

    def __init__(self, replica: TritonReplica):
        self.replica = replica

    def max_migrations(self, model: ModelConfig) -> int:
        return 0  # its Triton's loss ends the replica, and the client's connection

    async def stream(
        self, model: ModelConfig, params: GenerateParams
    ) -> AsyncIterator[GenerationChunk]:
        try:
            # aclosing: a client that goes away stops the engine's sequence at once.
            async with aclosing(self.replica.generate(params)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Exception as error:
            raise (as_api_error(error) or error) from None

    async def embed(self, model: ModelConfig, texts: list[str]) -> Embeddings:
        # The config admits no embeddings model beside a direct one (serve/config.py).
        raise NotFound(f"model {model.id!r} does not embed", param="model")

    async def not_ready(self) -> dict[str, str]:
        """This replica's own Triton (HAProxy sends a request only to a replica Serve
        counts healthy; a replica asked here is one of them)."""
        replica = self.replica
        if await replica.host.is_ready(replica.serving_model):
            return {}
        reason = "Triton is not ready: the server exited or the model is not loaded"
        return {replica.model.id: reason}
