"""The seam between a replica and its Triton server: one interface, two implementations.

- ``SidecarHost`` (``serve/engines/triton/sidecar.py``): the ``tritonserver`` binary as a
  supervised child process on loopback ports, spoken to with tritonclient's asyncio
  gRPC client. Works wherever the binary runs (the pytriton wheel on CPU, NGC images).
- ``InProcessHost`` (``serve/engines/triton/in_process.py``): the official ``tritonserver``
  Python API, Triton inside the replica's own process (NGC images, Python 3.12).

Nothing above ``serve/engines/triton/`` knows which one runs, and nothing above it sees a
tritonclient or tritonserver exception: each host turns Triton's errors into
:class:`serve.generation.GenerationError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import numpy as np

from serve.engines.triton.requests import ENSEMBLE_ROUTE, AdapterInputs, Route
from serve.generation import GenerateParams, GenerationChunk
from tritonllm import contract


class TritonHost(Protocol):
    """One Triton server owned by one replica."""

    def start(self) -> TritonHost:
        """Start Triton and wait until its models are ready (blocking: call it off the
        event loop). Raises with Triton's own log tail when it cannot start."""

    def stop(self) -> None:
        """Stop Triton; in-flight requests end with an error (blocking)."""

    async def is_ready(self, model: str = contract.ENSEMBLE) -> bool:
        """Triton alive and ``model`` ready (the replica's health check)."""

    def exited(self) -> bool:
        """Triton is gone without being stopped (a child process that died; never for
        Triton in the replica's own process, which dies with it)."""

    def generate(
        self,
        params: GenerateParams,
        route: Route = ENSEMBLE_ROUTE,
        adapter: AdapterInputs | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the answer along ``route`` (the ensemble, or the engine step with the
        replica's own tokenizing, :mod:`serve.engines.triton.steps`), with ``adapter``'s
        tensors where it is for a LoRA adapter: the text chunks, the last
        of them with the finish reason (the sidecar: with the tokens of Triton's final
        response where it holds any; the in-process host: an empty one). Closing the
        iterator early stops the generation in the engine."""

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One non-decoupled request (an embeddings model, say): named input arrays, batch
        dimension first, to named output arrays."""

    async def cancel(self, request_id: str, model: str = contract.ENSEMBLE) -> None:
        """Stop a running generation of ``model`` by request id (unknown ids: no-op)."""

    async def metrics(self) -> str:
        """Triton's Prometheus metrics text (engine metrics included)."""

    async def load_model(self, name: str) -> None:
        """Load ``name`` (explicit model control); an ensemble loads its steps too."""

    async def unload_model(self, name: str) -> None:
        """Unload ``name`` and wait until it is gone."""

    async def model_index(self) -> dict[str, str]:
        """The repository index: every model's name and state (``READY``, ``UNAVAILABLE``,
        ``LOADING``, ... ; models never loaded have the empty state)."""
