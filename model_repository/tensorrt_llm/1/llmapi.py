"""TensorRT-LLM's PyTorch backend in the tensorrt_llm slot: pb_utils <-> tritonllm.llmapi.

Loaded instead of model.py when `make engines TARGET=trtllm-pytorch` wrote the config
(``default_model_filename: "llmapi.py"``). Same tensors, decoupled, streaming.
"""

import triton_python_backend_utils as pb_utils

from tritonllm.engine.scheduler import EngineBusy, merge_chunks
from tritonllm.engine.tensors import chunk_to_tensors, is_stop_request, to_generation_request
from tritonllm.llmapi import LLMAPIEngine, llm_kwargs, load_options
from tritonllm.model_args import ModelArgs
from tritonllm.response_thread import ResponseThread
from tritonllm.tokenization import InvalidRequest
from tritonllm.triton_errors import triton_error

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonSink:
    """A request's response sender; the engine's loop writes, the response thread sends."""

    def __init__(self, request, sender, generation_request, responses: ResponseThread):
        self.cancelled = False  # set by the response thread's polling
        self._request = request
        self._sender = sender
        self._generation_request = generation_request
        self._responses = responses

    def send(self, chunk):
        self._responses.send(self, chunk)

    def fail(self, message, code="INTERNAL"):
        self._responses.send(self, triton_error(pb_utils, message, code))

    def is_cancelled(self):
        return self.cancelled

    def deliver(self, item):
        if isinstance(item, pb_utils.TritonError):
            self._sender.send(pb_utils.InferenceResponse(error=item), flags=_FINAL)
            return True
        chunk = item
        if chunk.finished and not chunk.token_ids and self._generation_request.streaming:
            self._sender.send(flags=_FINAL)
            return True
        tensors = chunk_to_tensors(chunk, self._generation_request)
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in tensors.items()]
        )
        self._sender.send(response, flags=_FINAL if chunk.finished else 0)
        return chunk.finished

    def poll_cancelled(self):
        return self._request.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        model_args = ModelArgs(args)
        # Imported here: loading TensorRT-LLM initialises CUDA and MPI.
        from tensorrt_llm import LLM, SamplingParams

        options = load_options(model_args.path("llm_api_options"))
        llm = LLM(**llm_kwargs(model_args.path("engine_dir"), options))
        # What the thread finds queued for a request leaves as one response (model.py too).
        self.responses = ResponseThread(poll_interval_s=0.02, merge=merge_chunks)
        self.engine = LLMAPIEngine(
            llm,
            SamplingParams,
            max_batch_size=model_args.int("max_batch_size", 64),
            max_queue_size=model_args.int("max_queue_size", 256),
            max_input_len=model_args.int("max_input_len", 0),
            max_seq_len=model_args.int("max_seq_len", 0),
        )

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request):
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        sender = request.get_response_sender()
        sink = None
        try:
            if is_stop_request(get):
                self.engine.cancel(request.request_id())
                sender.send(flags=_FINAL)
                return
            generation_request = to_generation_request(request.request_id(), get)
            sink = TritonSink(request, sender, generation_request, self.responses)
            self.responses.watch(sink)
            self.engine.submit(generation_request, sink)
        except (InvalidRequest, EngineBusy) as exc:
            if sink is not None:
                self.responses.unwatch(sink)
            code = "UNAVAILABLE" if isinstance(exc, EngineBusy) else "INVALID_ARG"
            error = triton_error(pb_utils, str(exc), code)
            sender.send(pb_utils.InferenceResponse(error=error), flags=_FINAL)

    def finalize(self):
        self.engine.shutdown()
        self.responses.close()
