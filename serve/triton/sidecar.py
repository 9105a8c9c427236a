"""The sidecar Triton host: the tritonserver binary as a child process, spoken to over gRPC.

One ``stream_infer`` call per request (tritonclient's asyncio client): Triton
closes the stream once the request's last response is out, which is how the end
of a decoupled request shows without ``enable_empty_final_response`` (the
asyncio client cannot set it), and a Triton error belongs to exactly one request.

Triton 2.51's ensemble does not pass a client's cancellation on to the
``tensorrt_llm`` step, so abandoning a generation also sends that step a
``stop`` request with the same request id (the engine frees the slot within a
step).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import tritonclient.grpc.aio as grpc_aio

from serve.triton.client import infer_inputs
from serve.triton.launcher import TritonProcess
from serve.triton.requests import (
    GenerateParams,
    GenerationChunk,
    chunk_from_outputs,
    ensemble_inputs,
    finish_reason,
    stop_inputs,
)
from tritonllm import contract

log = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """Triton refused or failed a request; ``retryable`` when the engine was full."""

    def __init__(self, message: str):
        super().__init__(message)
        self.retryable = "queue is full" in message


class SidecarHost:
    def __init__(self, repository: Path | str, start_timeout_s: float = 300.0):
        self.process = TritonProcess(Path(repository))
        self._start_timeout_s = start_timeout_s
        self._clients: dict[asyncio.AbstractEventLoop, grpc_aio.InferenceServerClient] = {}

    def start(self) -> SidecarHost:
        """Start Triton and wait until its models are ready (blocking)."""
        self.process.start(timeout_s=self._start_timeout_s)
        return self

    def stop(self) -> None:
        self.process.stop()

    async def close(self) -> None:
        """Close this event loop's gRPC channel."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    async def is_ready(self) -> bool:
        """Triton alive and the ensemble ready (what the replica's health check asks)."""
        if self.process.poll() is not None:
            return False
        try:
            return await self._client().is_model_ready(contract.ENSEMBLE)
        except Exception:
            return False

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerationChunk]:
        """Stream the answer's chunks, then one empty chunk with the finish reason."""

        async def requests():
            yield {
                "model_name": contract.ENSEMBLE,
                "inputs": infer_inputs(ensemble_inputs(params)),
                "request_id": params.request_id,
            }

        responses = self._client().stream_infer(requests())
        last = None
        done = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise GenerationError(str(error.message()))
                outputs = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
                if outputs:  # the empty final response of an EOS carries nothing
                    last = chunk_from_outputs(outputs, params)
                    yield last
            done = True
            yield GenerationChunk(
                text="",
                num_input_tokens=last.num_input_tokens if last else 0,
                num_output_tokens=last.num_output_tokens if last else 0,
                cum_log_prob=last.cum_log_prob if last else None,
                finish_reason=finish_reason(last, params),
            )
        finally:
            if not done:  # the caller went away (or Triton failed): free the engine
                responses.cancel()
                await asyncio.shield(self.cancel(params.request_id))

    async def cancel(self, request_id: str) -> None:
        """Stop a running generation by its request id (unknown ids are ignored)."""

        async def requests():
            yield {
                "model_name": contract.TENSORRT_LLM,
                "inputs": infer_inputs(stop_inputs()),
                "request_id": request_id,
            }

        try:
            async for _, error in self._client().stream_infer(requests()):
                if error is not None:
                    log.warning("stop for %s failed: %s", request_id, error)
        except Exception:
            log.exception("could not stop %s", request_id)

    def _client(self) -> grpc_aio.InferenceServerClient:
        """This event loop's channel (a gRPC asyncio channel belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            self._clients[loop] = grpc_aio.InferenceServerClient(self.process.grpc_url)
        return self._clients[loop]
