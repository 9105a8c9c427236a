"""``layout: direct``: the replica that owns Triton serves the OpenAI API itself.

With an ingress in front, every streamed chunk crosses one more process (the Triton
replica's generator to the ingress replica, a Ray object each) before HAProxy. An app
of one model that needs no routing by ``model``, variant, adapter or prefix has no use
for that hop: here each replica is the app's ingress, HAProxy (Ray Serve's direct
ingress) sends it the HTTP request, and it streams from its own Triton. The routes,
errors, API keys, limits and metrics are the ingress's own (``ApiBackend``). What the
layout gives up: a replica lost mid-answer takes its streams with it (with an ingress
they resume on another replica, serve/migration.py); the config says so
(docs/architecture.md#layouts).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from ray import serve

from serve.api.common.backend import Embeddings
from serve.api.common.errors import NotFound
from serve.config import AppConfig, ModelConfig
from serve.deployments.ingress import ApiBackend, as_api_error
from serve.engines.triton.replica import TritonReplica
from serve.generation import GenerateParams, GenerationChunk


@serve.ingress()  # the app is built in the replica, by __serve_build_asgi_app__
class DirectReplica(ApiBackend):
    """One Triton and the OpenAI app in one replica (``layout: direct``)."""

    async def __init__(
        self, model: ModelConfig, config: AppConfig, metrics_collector=None, response_store=None
    ):
        # The replica's Triton, and the same figures it publishes in the other layout
        # (here within this process's one publication: _metrics_text).
        self.triton = TritonReplica.__new__(TritonReplica)
        await self.triton.__init__(model, answers_http=True)
        # The API's tokenizer (chat template, migration) is the replica's own: one load.
        tokenizers = {model.id: self.triton.tokenizer}
        self._start_api(config, metrics_collector, response_store, tokenizers)

    async def _metrics_text(self) -> str:
        return self.metrics.text() + await self.triton.host.metrics()

    def _max_migrations(self, model: ModelConfig) -> int:
        return 0  # its Triton's loss ends the replica, and the client's connection

    async def _attempt(
        self, model: ModelConfig, params: GenerateParams
    ) -> AsyncIterator[GenerationChunk]:
        try:
            # aclosing: a client that goes away stops the engine's sequence at once.
            async with aclosing(self.triton.generate(params)) as chunks:
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
        model = self.triton.model
        if await self.triton.host.is_ready(self.triton.serving_model):
            return {}
        return {model.id: "Triton is not ready: the server exited or the model is not loaded"}

    async def check_health(self) -> None:
        await self.triton.check_health()

    def __del__(self):
        super().__del__()
        triton = getattr(self, "triton", None)
        if triton is not None:
            triton.__del__()
