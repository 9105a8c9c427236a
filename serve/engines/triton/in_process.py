"""The in-process Triton host: the official ``tritonserver`` Python API in the replica.

Written against triton-inference-server/core ``python/tritonserver`` (main at commit
73aad7c3, June 2026; the API of the 2.70+ wheels and the NGC 26.xx images):
``Server(Options)`` and ``start(wait_until_ready=True, timeout=...)``;
``Model.async_infer(InferenceRequest)`` gives an ``AsyncResponseIterator`` whose
responses end with one marked ``final`` (a decoupled model's last one may carry no
outputs) and whose ``cancel()`` cancels the request; ``Server.metrics()``,
``load``/``unload`` and ``models()``; errors are ``TritonError`` subclasses
(``InvalidArgumentError``, ``UnavailableError``, ...), raised while iterating.

Behaves as :class:`serve.engines.triton.sidecar.SidecarHost` does, with the same request and
chunk mapping (:mod:`serve.engines.triton.requests`). As there, abandoning a generation also
sends the ensemble's engine step a ``stop`` with the request id: Triton's ensemble
does not pass a cancellation on to its steps.

This module imports ``tritonserver``; :func:`serve.engines.triton.select.choose_host` only
imports it where that works (cp312 wheels needing GLIBCXX_3.4.32: NGC images, not
Debian 12).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import tritonserver

from serve.engines.triton.launcher import PYTHON_BACKEND_CONFIG
from serve.engines.triton.requests import ENSEMBLE_ROUTE, AdapterInputs, Route, stop_inputs
from serve.engines.triton.sidecar import classify
from serve.generation import GenerateParams, GenerationChunk, GenerationError
from tritonllm import contract

log = logging.getLogger(__name__)


class InProcessStartError(RuntimeError):
    pass


def _message(error: tritonserver.TritonError) -> str:
    # The API appends the failed response to an error's args: the message is the first.
    return str(error.args[0]) if error.args else repr(error)


def from_triton_error(error: tritonserver.TritonError) -> GenerationError:
    """Triton's typed errors first; TensorRT-LLM's backend answers most refusals with
    INTERNAL, so for the other types the words decide, as in the sidecar."""
    message = _message(error)
    if isinstance(error, tritonserver.InvalidArgumentError):
        return GenerationError(message, GenerationError.INVALID)
    if isinstance(error, tritonserver.UnavailableError):
        return GenerationError(message, GenerationError.UNAVAILABLE)
    return classify(message)


def to_numpy(tensor: tritonserver.Tensor) -> np.ndarray:
    """A response tensor as an array that outlives the response (outputs are on the host:
    no request here asks for device memory)."""
    if tensor.data_type == tritonserver.DataType.BYTES:
        return tensor.to_bytes_array()
    return np.array(np.from_dlpack(tensor.to_host()))


def response_outputs(response: tritonserver.InferenceResponse) -> dict[str, np.ndarray]:
    return {name: to_numpy(tensor) for name, tensor in response.outputs.items()}


class InProcessHost:
    """:class:`serve.engines.triton.host.TritonHost` on an in-process ``tritonserver.Server``."""

    def __init__(
        self,
        repository: Path | str,
        start_timeout_s: float = 300.0,
        backend_directory: str | None = None,
        startup_models: tuple[str, ...] = ("*",),
    ):
        self.repository = Path(repository).resolve()
        self._startup_models = list(startup_models)
        self._start_timeout_s = start_timeout_s
        self._backend_directory = backend_directory
        self._server: tritonserver.Server | None = None
        self._engine_steps: dict[str, str] = {}

    def options(self) -> tritonserver.Options:
        """Explicit model control with ``startup_models`` loaded at start ("*": all), as
        the sidecar does; load/unload work. Strict configs, as the sidecar's
        ``--disable-auto-complete-config``."""
        extra = {"backend_directory": self._backend_directory} if self._backend_directory else {}
        return tritonserver.Options(
            model_repository=str(self.repository),
            model_control_mode=tritonserver.ModelControlMode.EXPLICIT,
            startup_models=self._startup_models,
            strict_model_config=True,
            log_error=True,
            log_warn=True,
            # Several replicas share a node: each server's Python-backend shared-memory
            # regions get their own names (NVIDIA sets this per server on Slurm too), and
            # pools that never grow under load (launcher.PYTHON_BACKEND_CONFIG).
            backend_configuration={
                "python": {
                    **PYTHON_BACKEND_CONFIG,
                    "shm-region-prefix-name": f"tritonllm{os.getpid()}_",
                }
            },
            **extra,
        )

    def start(self) -> InProcessHost:
        """Start Triton in this process and wait until its models are ready (blocking)."""
        if not self.repository.is_dir():
            raise InProcessStartError(f"model repository {self.repository} does not exist")
        server = tritonserver.Server(self.options())
        try:
            server.start(wait_until_ready=True, timeout=self._start_timeout_s)
        except tritonserver.TritonError as error:
            self._stop(server)
            raise InProcessStartError(
                f"in-process Triton on {self.repository} did not start: {_message(error)} "
                "(Triton's log above names the model that failed)"
            ) from None
        self._server = server
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            self._stop(server)

    @staticmethod
    def _stop(server: tritonserver.Server) -> None:
        try:
            server.stop()
        except tritonserver.TritonError as error:
            log.warning("stopping in-process Triton: %s", _message(error))

    def exited(self) -> bool:
        return False  # a Triton that dies takes this process with it

    async def is_ready(self, model: str = contract.ENSEMBLE) -> bool:
        if self._server is None:
            return False
        try:
            return self._server.ready() and self._server.model(model).ready()
        except tritonserver.TritonError:
            return False

    async def generate(
        self,
        params: GenerateParams,
        route: Route = ENSEMBLE_ROUTE,
        adapter: AdapterInputs | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the answer's chunks, then one empty chunk with the finish reason."""
        model, reader = route.model, route.reader(params)
        inputs = route.inputs(params, adapter)
        responses = None
        done = False
        try:
            try:
                responses = (
                    self._require()
                    .model(model)
                    .async_infer(inputs=inputs, request_id=params.request_id)
                )
                async for response in responses:
                    outputs = response_outputs(response)
                    if outputs:  # a decoupled model's final response may be empty
                        yield reader.chunk(outputs)
            except tritonserver.TritonError as error:
                raise from_triton_error(error) from None
            done = True
            yield reader.end()
        finally:
            if not done:  # the caller went away (or Triton failed): free the engine
                if responses is not None:
                    responses.cancel()
                await asyncio.shield(self.cancel(params.request_id, model))

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs: dict[str, np.ndarray] = {}
        try:
            async for response in self._require().model(model).async_infer(inputs=inputs):
                outputs.update(response_outputs(response))
        except tritonserver.TritonError as error:
            raise from_triton_error(error) from None
        return outputs

    async def cancel(self, request_id: str, model: str = contract.ENSEMBLE) -> None:
        """Stop a running generation by its request id (unknown ids are ignored)."""
        if self._server is None:
            return  # a stopped Triton has nothing left to stop
        try:
            step = self._engine_step(model)
            stop = self._server.model(step).async_infer(
                inputs=stop_inputs(), request_id=request_id, raise_on_error=False
            )
            async for response in stop:
                if response.error is not None:
                    log.warning("stop for %s failed: %s", request_id, _message(response.error))
        except tritonserver.TritonError as error:
            log.warning("could not stop %s: %s", request_id, _message(error))

    def _engine_step(self, model: str) -> str:
        """The ensemble step fed ``input_ids``: where a ``stop`` must go."""
        if model not in self._engine_steps:
            config = self._require().model(model).config()
            steps = config.get("ensemble_scheduling", {}).get("step", [])
            engines = [
                s["model_name"] for s in steps if contract.INPUT_IDS.name in s.get("input_map", {})
            ]
            self._engine_steps[model] = engines[0] if engines else model
        return self._engine_steps[model]

    async def metrics(self) -> str:
        # Formats every metric family in C: off the event loop.
        return await asyncio.to_thread(self._require().metrics)

    async def load_model(self, name: str) -> None:
        try:
            await asyncio.to_thread(self._require().load, name)  # waits for READY
        except tritonserver.TritonError as error:
            raise GenerationError(_message(error), GenerationError.INTERNAL) from None

    async def unload_model(self, name: str) -> None:
        self._engine_steps.pop(name, None)
        server = self._require()
        try:
            await asyncio.to_thread(server.unload, name, wait_until_unloaded=True)
        except tritonserver.TritonError as error:
            raise GenerationError(_message(error), GenerationError.INTERNAL) from None

    async def model_index(self) -> dict[str, str]:
        models = await asyncio.to_thread(self._require().models)
        return {name: model.state or "" for (name, _version), model in models.items()}

    def _require(self) -> tritonserver.Server:
        if self._server is None:
            raise GenerationError("Triton is not running", GenerationError.UNAVAILABLE)
        return self._server
