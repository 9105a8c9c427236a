"""One gRPC stream to Triton that carries every request of the replica's event loop.

A gRPC stream per request (tritonclient's ``stream_infer``) makes the replica's event
loop set up and tear down a call, a request iterator and a reader task for each
request, paid in the burst of arrivals that decides time to first token. Triton's
``ModelStreamInfer`` carries any number of requests at once and stamps each response
with its request's id, so one long-lived stream serves them all: requests are written
to it as they come, and one reader task hands each response to its request's queue.

The end of a request is Triton's: ``triton_enable_empty_final_response`` makes its
last response carry ``triton_final_response``. An error response ends its request too,
flagged or not (Triton 2.51 leaves a core error, such as an unknown model, unflagged;
checked on this repository's Triton). If the stream itself fails (Triton died), every
request on it gets the failure, and the next request opens a new stream.

Request messages are built here from numpy arrays, and responses read back into them,
not through tritonclient's ``InferInput`` and ``InferResult`` objects: the same
protobuf fields, without a Python object per tensor per message on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import (
    deserialize_bytes_tensor,
    np_to_triton_dtype,
    serialize_byte_tensor,
    triton_to_np_dtype,
)

log = logging.getLogger(__name__)

FINAL = "triton_final_response"
# Unlimited message sizes, as tritonclient's channels: a LoRA adapter's weights, a
# prompt's log probabilities, travel as single messages.
_CHANNEL_OPTIONS = (("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1))


class StreamLost(Exception):
    """The shared stream ended under a request (Triton died or broke the stream)."""


def infer_request(
    model: str, values: dict[str, np.ndarray], request_id: str, outputs=()
) -> service_pb2.ModelInferRequest:
    """A ``ModelInferRequest`` whose last response is flagged final (an empty one if
    need be)."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in values.items():
        if array.dtype == object:
            wire, content = "BYTES", serialize_byte_tensor(array)
            content = content.item() if content.size else b""
        else:
            wire, content = np_to_triton_dtype(array.dtype), array.tobytes()
        request.inputs.add(name=name, datatype=wire, shape=array.shape)
        request.raw_input_contents.append(content)
    for name in outputs:
        request.outputs.add(name=name)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def response_arrays(response: service_pb2.ModelInferResponse) -> dict[str, np.ndarray]:
    """A response's outputs by name, decoded as tritonclient's ``InferResult.as_numpy``
    decodes them (Triton sends every output in ``raw_output_contents``), in one pass
    over them; the arrays are read-only views of the message's bytes."""
    arrays = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if tensor.datatype == "BYTES":
            array = deserialize_bytes_tensor(raw)
        else:
            array = np.frombuffer(raw, dtype=_numpy_dtype(tensor.datatype))
        arrays[tensor.name] = array.reshape(tensor.shape)
    return arrays


_numpy_dtype = functools.lru_cache(maxsize=None)(triton_to_np_dtype)


class _Request:
    """A request's place on the stream: its responses' queue, then ``None`` (its end)
    or a :class:`StreamLost`."""

    __slots__ = ("responses", "abandoned")

    def __init__(self) -> None:
        self.responses: asyncio.Queue = asyncio.Queue()
        self.abandoned = False


class _Stream:
    """One ``ModelStreamInfer`` call, its requests in flight by id, and its reader."""

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub):
        self.requests: dict[str, _Request] = {}
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.call = stub.ModelStreamInfer(self._written())
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _written(self):
        while (request := await self.outgoing.get()) is not None:
            yield request

    async def _read(self) -> None:
        reason = "the stream ended"
        try:
            async for response in self.call:
                self._dispatch(response)
        except grpc.RpcError as error:
            reason = error.details() or str(error.code())
        except asyncio.CancelledError:
            reason = "the stream was closed"
        finally:
            lost = StreamLost(reason)
            for request in self.requests.values():
                request.responses.put_nowait(lost)
            self.requests.clear()

    def _dispatch(self, response: service_pb2.ModelStreamInferResponse) -> None:
        request_id = response.infer_response.id
        request = self.requests.get(request_id)
        if request is None:  # what comes after an error, or after an abandoned one's drain
            return
        ended = bool(response.error_message) or response.infer_response.parameters[FINAL].bool_param
        if not request.abandoned:
            request.responses.put_nowait(response)
        if ended:
            del self.requests[request_id]
            request.responses.put_nowait(None)


class SharedStream:
    """The replica's one stream to Triton (per event loop: gRPC's asyncio channels
    belong to the loop that made them)."""

    def __init__(self, url: str):
        self._channel = grpc.aio.insecure_channel(url, options=_CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._stream: _Stream | None = None

    def submit(self, request: service_pb2.ModelInferRequest) -> asyncio.Queue:
        """Send ``request``; its responses arrive on the queue returned, then ``None``
        once it ended, or a :class:`StreamLost`."""
        if self._stream is None or self._stream.reader.done():
            self._stream = _Stream(self._stub)
        if request.id in self._stream.requests:
            raise ValueError(f"request id {request.id!r} is already in flight")
        self._stream.requests[request.id] = entry = _Request()
        self._stream.outgoing.put_nowait(request)
        return entry.responses

    def abandon(self, request_id: str, drain_s: float) -> None:
        """Drop what else comes for a request its caller left (its stop is the caller's
        to send); forget it after ``drain_s`` if its end never comes."""
        stream = self._stream
        request = stream.requests.get(request_id) if stream else None
        if request is None:  # already ended, or its stream was lost
            return
        request.abandoned = True

        def forget() -> None:
            if stream.requests.get(request_id) is request:
                log.warning("request %s did not end %.0f s after its stop", request_id, drain_s)
                del stream.requests[request_id]

        asyncio.get_running_loop().call_later(drain_s, forget)

    async def close(self, drain_s: float) -> None:
        """End the stream once its requests have ended (``drain_s`` at most), then close
        the channel. Cancelling a stream with an ensemble request in flight would leave
        that request in flight in Triton 2.51 for good: an unload of the ensemble would
        then wait forever."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.outgoing.put_nowait(None)  # Triton ends the stream after their last
            try:
                await asyncio.wait_for(asyncio.shield(stream.reader), drain_s)
            except asyncio.TimeoutError:
                log.warning(
                    "%d requests still in flight: cancelling the stream", len(stream.requests)
                )
                stream.reader.cancel()
        await self._channel.close()
