"""The sidecar Triton host: the tritonserver binary as a child process, spoken to over gRPC.

One ``stream_infer`` call per request (tritonclient's asyncio client): Triton
closes the stream once the request's last response is out, which is how the end
of a decoupled request shows without ``enable_empty_final_response`` (the
asyncio client cannot set it), and a Triton error belongs to exactly one request.

Triton 2.51's ensemble does not pass a client's cancellation on to the
``tensorrt_llm`` step, so abandoning a generation sends that step a ``stop``
request with the same request id (the engine frees the slot within a step) and
reads the stream to its end.
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

from serve.generation import GenerateParams, GenerationChunk, GenerationError
from serve.triton.client import infer_inputs
from serve.triton.launcher import TritonProcess
from serve.triton.requests import ENSEMBLE_ROUTE, Route, stop_inputs
from tritonllm import contract

log = logging.getLogger(__name__)

# A gRPC stream response carries only Triton's error *message*, not its status code
# (ModelStreamInferResponse.error_message), so the sidecar reads the kind from the
# words the engines use: the torch engine's and TensorRT-LLM's backend's.
_UNAVAILABLE = re.compile(r"queue is full|not ready|unavailable|shutting down|cannot process new")
_INVALID = re.compile(r"must be|must hold|exceeds|is empty|not supported|invalid|outside|unknown")


# How long an abandoned request's stream may take to end after its stop (a step or two).
ABANDON_DRAIN_S = 10.0


_END = object()


class _StreamReader:
    """A gRPC response stream read by a task of its own into a queue, so that a
    cancelled consumer leaves the call alone (see ``SidecarHost.generate``)."""

    def __init__(self, responses):
        self._queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._pump(responses))

    async def _pump(self, responses) -> None:
        try:
            async for item in responses:
                self._queue.put_nowait(item)
        except grpc.RpcError as error:
            self._queue.put_nowait(error)
        finally:
            self._queue.put_nowait(_END)

    async def next(self):
        """The next ``(result, error)``, or ``_END``; raises the stream's own failure."""
        item = await self._queue.get()
        if isinstance(item, grpc.RpcError):
            raise item
        return item


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
    """:class:`serve.triton.host.TritonHost` on a child ``tritonserver`` process."""

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
        """Close this event loop's gRPC channel."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

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
        self, params: GenerateParams, route: Route = ENSEMBLE_ROUTE
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the answer's chunks, then one empty chunk with the finish reason."""
        model = route.model
        declared = await self._declared_outputs(model)
        names = [name for name in route.outputs(params) if name in declared]
        inputs = infer_inputs(route.inputs(params))

        async def requests():
            yield {
                "model_name": model,
                "inputs": inputs,
                "outputs": [grpc_aio.InferRequestedOutput(name) for name in names],
                "request_id": params.request_id,
            }

        # Read by a task of its own: when Serve cancels the replica's generator (the
        # client went away), the cancellation must not reach the gRPC call. Triton 2.51
        # keeps ~6 KiB of every cancelled stream for good (measured: 6.1-6.8 KiB per
        # request, against ~0.3 KiB for streams read to their end; make soak shows it as
        # tritonserver's resident memory growing); a stop ends the stream instead.
        reader = _StreamReader(self._client().stream_infer(requests()))
        responses = route.reader(params)
        done = False
        try:
            while (item := await reader.next()) is not _END:
                result, error = item
                if error is not None:
                    if "is not healthy" in str(error.message()):  # a dead stub: say how
                        self._stubs_died()
                    raise classify(str(error.message()))
                if result.get_response().outputs:  # an EOS's empty final response: none
                    arrays = {name: result.as_numpy(name) for name in names}
                    yield responses.chunk({k: v for k, v in arrays.items() if v is not None})
            done = True
            yield responses.end()
        except grpc.RpcError as error:  # the stream itself broke
            raise self._lost(error.details()) from None
        finally:
            if not done:  # the caller went away (or Triton failed): free the engine
                await asyncio.shield(self._abandon(reader, params.request_id, model))

    async def _abandon(self, reader: _StreamReader, request_id: str, model: str) -> None:
        """Stop the engine's sequence; the reader then reads the stream to its end.

        Cancelling the gRPC stream instead would leave the ensemble's request in flight
        for good in Triton 2.51 (its steps finish, the ensemble never does): an unload
        of the ensemble, as multiplexing does, then waits forever. Only a stream that
        does not end within ``ABANDON_DRAIN_S`` (a wedged Triton) is cancelled.
        """
        await self.cancel(request_id, model)
        try:
            await asyncio.wait_for(asyncio.shield(reader.task), ABANDON_DRAIN_S)
        except asyncio.TimeoutError:
            log.warning("request %s did not end after its stop: cancelling", request_id)
            reader.task.cancel()

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            result = await self._client().infer(model, infer_inputs(inputs))
        except InferenceServerException as error:
            raise _from_status(error) from None
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}

    def _lost(self, details: str | None) -> GenerationError:
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
