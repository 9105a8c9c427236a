"""The Triton replica: one Triton server per Serve replica, streaming chunks to the ingress."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from serve.config import AppConfig
from serve.triton.requests import GenerateParams, GenerationChunk
from serve.triton.select import choose_host

log = logging.getLogger(__name__)


class TritonReplica:
    """Plain class; ``serve.deployment`` wraps it in :func:`serve.app.build_app`."""

    def __init__(self, config: AppConfig, host=None):
        self.config = config
        self.host = host or choose_host(config.triton).start()

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerationChunk]:
        async for chunk in self.host.generate(params):
            yield chunk

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy."""
        if not await self.host.is_ready():
            raise RuntimeError("Triton is not ready (process exited or models not loaded)")

    def __del__(self):
        # Serve tears a replica down by deleting its actor; Triton must not outlive it.
        host = getattr(self, "host", None)
        if host is not None:
            try:
                host.stop()
            except Exception:
                log.exception("stopping Triton failed")
