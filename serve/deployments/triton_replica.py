"""The Triton replica: one Triton server per Serve replica, streaming chunks to the ingress."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from serve.config import ModelConfig
from serve.metrics import TritonMetricsExporter
from serve.triton.host import TritonHost
from serve.triton.requests import GenerateParams, GenerationChunk
from serve.triton.select import choose_host

log = logging.getLogger("ray.serve")


class TritonReplica:
    """Plain class; ``serve.deployment`` wraps it in :func:`serve.app.build_app`.

    Serve counts the replica ready when ``__init__`` returns, which is after Triton
    reports every model of the repository ready; a repository that fails to load
    raises here with Triton's own message, which Serve shows in the deployment's
    status. On shutdown Serve first drains the replica (up to
    ``graceful_shutdown_timeout_s``), then ``__del__`` stops Triton.
    """

    async def __init__(self, model: ModelConfig, host: TritonHost | None = None):
        self.model = model
        self.host = host or choose_host(model.triton)
        # Starting Triton blocks for seconds to minutes: off the event loop.
        await asyncio.to_thread(self.host.start)
        self._metrics = TritonMetricsExporter(self.host.metrics)
        self._metrics.start()

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerationChunk]:
        async for chunk in self.host.generate(params, self.model.entry_model()):
            yield chunk

    async def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; raising marks the replica
        unhealthy (three failures in a row and Serve replaces it)."""
        if not await self.host.is_ready(self.model.entry_model()):
            raise RuntimeError(
                f"Triton is not ready: the server exited or {self.model.entry_model()} "
                "is not loaded"
            )

    def __del__(self):
        # Serve deletes a replica after draining it; Triton must not outlive it.
        metrics = getattr(self, "_metrics", None)
        if metrics is not None:
            metrics.stop()
        host = getattr(self, "host", None)
        if host is not None:
            try:
                host.stop()
            except Exception:
                log.exception("stopping Triton failed")
