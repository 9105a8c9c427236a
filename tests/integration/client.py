"""A small gRPC-streaming ensemble client for the tests (tritonclient)."""

from __future__ import annotations

import queue
import uuid
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


def make_inputs(prompt: str, max_tokens: int | None, **optional) -> list:
    values = {"text_input": np.array([[prompt.encode()]], dtype=object)}
    if max_tokens is not None:
        values["max_tokens"] = np.array([[max_tokens]], dtype=np.int32)
    for name, value in optional.items():
        spec = contract.tensor(contract.ENSEMBLE, name)
        if isinstance(value, np.ndarray):
            array = value
        elif spec.triton_dtype == "TYPE_STRING":
            array = np.array([[w.encode() for w in value]], dtype=object)
        else:
            array = np.array([[value]], dtype=spec.numpy_dtype)
        values[name] = array
    inputs = []
    for name, array in values.items():
        wire = "BYTES" if array.dtype == object else grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), wire)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def generate(
    url: str,
    prompt: str,
    max_tokens: int | None = 16,
    timeout_s: float = 60,
    request_id: str | None = None,
    **optional,
) -> Result:
    """Run one ensemble request over a gRPC stream; raise on a Triton error."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(
            "ensemble",
            make_inputs(prompt, max_tokens, **optional),
            request_id=request_id or uuid.uuid4().hex,
            enable_empty_final_response=True,
        )
        chunks, outputs = [], []
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                raise error
            response = result.get_response()
            if response.outputs:
                chunks.append(result.as_numpy("text_output").reshape(-1)[0].decode())
                outputs.append({o.name: result.as_numpy(o.name) for o in response.outputs})
            if response.parameters["triton_final_response"].bool_param:
                return Result(chunks, outputs)
    finally:
        client.stop_stream()
        client.close()
