"""The sidecar Triton host: the tritonserver binary as a child process, spoken to over gRPC.

Every generation of an event loop travels on one long-lived gRPC stream
(:mod:`serve.engines.triton.shared_stream`): Triton stamps each response with its request's
id and flags each request's last, so a Triton error belongs to exactly one request
and the stream outlives it.

Triton 2.51's ensemble does not pass a client's cancellation on to the
``tensorrt_llm`` step, so abandoning a generation sends that step a ``stop``
request with the same request id (the engine frees the slot within a step); the
shared stream drops what else comes for it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc.aio as grpc_aio
from tritonclient.utils import InferenceServerException

from serve.engines.triton.client import infer_inputs
from serve.engines.triton.launcher import TritonProcess
from serve.engines.triton.requests import ENSEMBLE_ROUTE, AdapterInputs, Route, stop_inputs
from serve.engines.triton.shared_stream import (
    FINAL,
    SharedStream,
    StreamLost,
    infer_request,
    response_arrays,
)
from serve.generation import GenerateParams, GenerationChunk, GenerationError
from tritonllm import contract

log = logging.getLogger(__name__)

# A gRPC stream response carries only Triton's error *message*, not its status code
# (ModelStreamInferResponse.error_message), so the sidecar reads the kind from the
# words the engines use: the torch engine's and TensorRT-LLM's backend's.
_UNAVAILABLE = re.compile(r"queue is full|not ready|unavailable|shutting down|cannot process new")
_INVALID = re.compile(r"must be|must hold|exceeds|is empty|not supported|invalid|outside|unknown")


# How long an abandoned request's responses are waited for after its stop (a step or
# two) before the shared stream forgets it, and how long closing the stream waits for
# the requests on it.
ABANDON_DRAIN_S = 10.0


def classify(message: str) -> GenerationError:
    text = message.lower()
    if _UNAVAILABLE.search(text):
        return GenerationError(message, GenerationError.UNAVAILABLE)
    if _INVALID.search(text):
        return GenerationError(message, GenerationError.INVALID)
    return GenerationError(message, GenerationError.INTERNAL)


def _from_status(error: InferenceServerException) -> GenerationError:
    """A unary call's error carries its gRPC status code: trust it over the words."""
    status = error.status() or ""
    if "INVALID_ARGUMENT" in status:
        return GenerationError(str(error.message()), GenerationError.INVALID)
    if "UNAVAILABLE" in status or "RESOURCE_EXHAUSTED" in status:
        return GenerationError(str(error.message()), GenerationError.UNAVAILABLE)
    return classify(str(error.message()))


class SidecarHost:
    """:class:`serve.engines.triton.host.TritonHost` on a child ``tritonserver`` process."""

    def __init__(
        self,
        repository: Path | str,
        start_timeout_s: float = 300.0,
        startup_models: tuple[str, ...] = ("*",),
    ):
        # Explicit model control, so that load_model/unload_model work; the models
        # loaded at start ("*": all of them) are what the replica serves at once.
        loads = tuple(f"--load-model={m}" for m in startup_models)
        self.process = TritonProcess(
            Path(repository), extra_args=("--model-control-mode=explicit", *loads)
        )
        self._start_timeout_s = start_timeout_s
        self._stopped = False
        self._clients: dict[asyncio.AbstractEventLoop, grpc_aio.InferenceServerClient] = {}
        self._streams: dict[asyncio.AbstractEventLoop, SharedStream] = {}
        self._engine_steps: dict[str, str] = {}
        self._outputs: dict[str, frozenset[str]] = {}
        self._stub_death_logged = False

    def start(self) -> SidecarHost:
        """Start Triton and wait until it is ready (blocking)."""
        self.process.start(timeout_s=self._start_timeout_s)
        return self

    def stop(self) -> None:
        self._stopped = True
        self.process.stop()

    def exited(self) -> bool:
        return not self._stopped and self.process.poll() is not None

    async def close(self) -> None:
        """Close this event loop's gRPC channels."""
        loop = asyncio.get_running_loop()
        client, stream = self._clients.pop(loop, None), self._streams.pop(loop, None)
        if client is not None:
            await client.close()
        if stream is not None:
            await stream.close(ABANDON_DRAIN_S)

    async def is_ready(self, model: str = contract.ENSEMBLE) -> bool:
        """Triton alive, each of its Python-backend stubs alive, and ``model`` ready
        (what the replica's health check asks). Triton 2.51 calls a model whose stub died
        ready still, and it never serves again: the replica must be replaced."""
        if self.process.poll() is not None or self._stubs_died():
            return False
        try:
            return await self._client().is_model_ready(model)
        except (InferenceServerException, grpc.RpcError):
            return False

    def _stubs_died(self) -> bool:
        """Whether a stub of this Triton died; the first time, the replica's log says how,
        with the tail of Triton's log (a crash's native stack, the model's last words)."""
        dead = self.process.dead_stubs()
        if dead and not self._stub_death_logged:
            self._stub_death_logged = True
            log.error(
                "Triton's Python-backend stub died (%s): its model serves no more; "
                "Triton's log %s ends:\n%s",
                ", ".join(dead),
                self.process.log_path,
                self.process.log_tail(60),
            )
        return bool(dead)

    async def generate(
        self,
        params: GenerateParams,
        route: Route = ENSEMBLE_ROUTE,
        adapter: AdapterInputs | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the answer's chunks; the last one carries the finish reason (Triton's
        final response and the end of the answer in one chunk: one event less per
        stream downstream)."""
        model = route.model
        declared = await self._declared_outputs(model)
        names = [name for name in route.outputs(params) if name in declared]
        request = infer_request(model, route.inputs(params, adapter), params.request_id, names)
        stream = self._stream()
        responses = stream.submit(request)
        reader = route.reader(params)
        ended = False  # by Triton: the request's final response or its error
        try:
            while (response := await responses.get()) is not None:
                if isinstance(response, StreamLost):
                    raise self._lost(str(response))
                if response.error_message:
                    ended = True
                    if "is not healthy" in response.error_message:  # a dead stub: say how
                        self._stubs_died()
                    raise classify(response.error_message)
                answer = response.infer_response
                final = answer.parameters[FINAL].bool_param
                if not answer.outputs:  # an EOS's empty final response
                    continue
                chunk = reader.chunk(response_arrays(answer))
                if final:  # the last tokens and the finish reason: one chunk, one event
                    ended = True
                    yield chunk.merged(reader.end())
                    return
                yield chunk
            ended = True
            yield reader.end()
        finally:
            if not ended:  # the caller went away (or the stream broke): free the engine
                stream.abandon(params.request_id, ABANDON_DRAIN_S)
                await asyncio.shield(self.cancel(params.request_id, model))

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            result = await self._client().infer(model, infer_inputs(inputs))
        except InferenceServerException as error:
            raise _from_status(error) from None
        return response_arrays(result.get_response())

    def _lost(self, details: str) -> GenerationError:
        """The gRPC stream failed: Triton died or is going away (retry elsewhere)."""
        state = "exited" if self.process.poll() is not None else "broke the stream"
        return GenerationError(f"Triton {state}: {details}", GenerationError.UNAVAILABLE)

    async def cancel(self, request_id: str, model: str = contract.ENSEMBLE) -> None:
        """Stop a running generation by its request id (unknown ids are ignored)."""
        try:
            step = await self._engine_step(model)

            async def requests():
                yield {
                    "model_name": step,
                    "inputs": infer_inputs(stop_inputs()),
                    "request_id": request_id,
                }

            async for _, error in self._client().stream_infer(requests()):
                if error is not None:
                    log.warning("stop for %s failed: %s", request_id, error)
        except (InferenceServerException, grpc.RpcError) as error:
            if self.process.poll() is None:  # a dead Triton has nothing left to stop
                log.warning("could not stop %s: %s", request_id, error)

    async def _declared_outputs(self, model: str) -> frozenset[str]:
        """The outputs ``model`` declares: a repository built for TensorRT-LLM lacks our
        engine extensions (``num_cached_tokens``, ...), which Triton would refuse to be
        asked for. Read once per model."""
        if model not in self._outputs:
            try:
                config = await self._client().get_model_config(model, as_json=True)
            except InferenceServerException as error:
                raise _from_status(error) from None
            self._outputs[model] = frozenset(o["name"] for o in config["config"]["output"])
        return self._outputs[model]

    async def _engine_step(self, model: str) -> str:
        """The ensemble step that runs the engine (the one fed ``input_ids``): where a
        ``stop`` must go, since the ensemble does not pass cancellation on."""
        if model not in self._engine_steps:
            config = await self._client().get_model_config(model, as_json=True)
            steps = config["config"].get("ensemble_scheduling", {}).get("step", [])
            engines = [
                s["model_name"] for s in steps if contract.INPUT_IDS.name in s.get("input_map", {})
            ]
            self._engine_steps[model] = engines[0] if engines else model
        return self._engine_steps[model]

    async def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.process.metrics_port}/metrics"

        def fetch() -> str:  # a loopback GET; off the event loop all the same
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read().decode()

        return await asyncio.to_thread(fetch)

    async def load_model(self, name: str) -> None:
        try:
            await self._client().load_model(name)
        except InferenceServerException as error:
            raise GenerationError(str(error.message()), GenerationError.INTERNAL) from None

    async def unload_model(self, name: str) -> None:
        self._engine_steps.pop(name, None)
        self._outputs.pop(name, None)
        try:
            await self._client().unload_model(name)
        except InferenceServerException as error:
            raise GenerationError(str(error.message()), GenerationError.INTERNAL) from None

    async def model_index(self) -> dict[str, str]:
        index = await self._client().get_model_repository_index(as_json=True)
        return {m["name"]: m.get("state", "") for m in index.get("models", [])}

    def _client(self) -> grpc_aio.InferenceServerClient:
        """This event loop's channel (a gRPC asyncio channel belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if loop not in self._clients:
            self._clients[loop] = grpc_aio.InferenceServerClient(self.process.grpc_url)
        return self._clients[loop]

    def _stream(self) -> SharedStream:
        """This event loop's stream for generations."""
        loop = asyncio.get_running_loop()
        if loop not in self._streams:
            self._streams[loop] = SharedStream(self.process.grpc_url)
        return self._streams[loop]
