"""A small gRPC-streaming Triton client (tritonclient): the tests' and benchmarks' client.

Responses carry the ``time.perf_counter()`` of their arrival, taken in
tritonclient's callback, so latency figures do not include queueing in here.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient

from tritonllm import contract


@dataclass
class Result:
    chunks: list[str]
    responses: list[dict]

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def ensemble_values(prompt: str, max_tokens: int | None, **optional) -> dict[str, np.ndarray]:
    """The ensemble's inputs: ``optional`` holds others by name (a list for a STRING one)."""
    given = {contract.TEXT_INPUT.name: [prompt], contract.MAX_TOKENS.name: max_tokens}
    values = {}
    for name, value in (given | optional).items():
        if value is None:  # max_tokens left out (to see the ensemble refuse it)
            continue
        spec = contract.tensor(contract.ENSEMBLE, name)
        if isinstance(value, np.ndarray):
            array = value
        elif spec.triton_dtype == "TYPE_STRING":
            array = np.array([[w.encode() for w in value]], dtype=object)
        else:
            array = np.array([[value]], dtype=spec.numpy_dtype)
        values[name] = array
    return values


def infer_inputs(values: dict[str, np.ndarray]) -> list:
    inputs = []
    for name, array in values.items():
        wire = "BYTES" if array.dtype == object else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), wire)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class Stream:
    """One gRPC bidirectional stream: send requests, read their responses."""

    def __init__(self, url: str):
        self._responses: queue.Queue = queue.Queue()
        self._client = grpcclient.InferenceServerClient(url)
        self._client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        self._responses.put((time.perf_counter(), result, error))

    def send(self, model: str, values: dict[str, np.ndarray], request_id: str) -> None:
        self._client.async_stream_infer(
            model, infer_inputs(values), request_id=request_id, enable_empty_final_response=True
        )

    def responses(self, timeout_s: float = 60) -> Iterator:
        """Results up to and including the final one; a Triton error is raised."""
        for _, result in self.timed_responses(timeout_s):
            yield result

    def timed_responses(self, timeout_s: float = 60) -> Iterator[tuple[float, object]]:
        """``(arrival time, result)`` pairs, as :meth:`responses`."""
        while True:
            arrived, result, error = self._responses.get(timeout=timeout_s)
            if error is not None:
                raise error
            yield arrived, result
            if result.get_response().parameters["triton_final_response"].bool_param:
                return

    def close(self, cancel_requests: bool = False) -> None:
        self._client.stop_stream(cancel_requests=cancel_requests)
        self._client.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def generate(
    url: str,
    prompt: str,
    max_tokens: int | None = 16,
    timeout_s: float = 60,
    request_id: str | None = None,
    **optional,
) -> Result:
    """Run one ensemble request over a gRPC stream; raise on a Triton error."""
    with Stream(url) as stream:
        values = ensemble_values(prompt, max_tokens, **optional)
        stream.send(contract.ENSEMBLE, values, request_id or uuid.uuid4().hex)
        chunks, outputs = [], []
        for result in stream.responses(timeout_s):
            response = result.get_response()
            if response.outputs:
                chunks.append(result.as_numpy(contract.TEXT_OUTPUT.name).reshape(-1)[0].decode())
                outputs.append({o.name: result.as_numpy(o.name) for o in response.outputs})
        return Result(chunks, outputs)
