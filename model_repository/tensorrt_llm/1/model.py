"""The torch engine in TensorRT-LLM's slot: pb_utils <-> tritonllm.engine (decoupled)."""

import triton_python_backend_utils as pb_utils

from tritonllm.engine.null_engine import NullRunner
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.scheduler import Engine, EngineBusy, merge_chunks
from tritonllm.engine.tensors import chunk_to_tensors, is_stop_request, to_generation_request
from tritonllm.model_args import ModelArgs
from tritonllm.response_thread import ResponseThread
from tritonllm.tokenization import InvalidRequest
from tritonllm.triton_errors import triton_error
from tritonllm.triton_metrics import EngineMetrics

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonSink:
    """A request's response sender, written to by the engine through the response thread."""

    def __init__(self, request, sender, generation_request, responses: ResponseThread):
        self.cancelled = False  # set by the response thread's polling
        self._request = request
        self._sender = sender
        self._generation_request = generation_request
        self._responses = responses

    # The engine's side (tritonllm.engine.scheduler.ResponseSink): never blocks.

    def send(self, chunk):
        self._responses.send(self, chunk)

    def fail(self, message):
        self._responses.send(self, triton_error(pb_utils, message, "INTERNAL"))

    def is_cancelled(self):
        return self.cancelled

    # The response thread's side: the round trips to the server.

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


def _runner(model_args):
    """The torch engine's model, or the null engine (a benchmark instrument: no model
    math, a fixed step time) when the repository was built with ``--target null``."""
    if model_args.str("engine", "torch") == "null":
        return NullRunner(
            model_args.path("engine_dir"),
            step_s=float(model_args.str("null_step_ms", "5")) / 1000,
            answer_tokens=model_args.int("null_answer_tokens", 0),
        )
    return CausalLMRunner(
        model_args.path("engine_dir"),
        device=model_args.str("device", "auto"),
        dtype=model_args.str("dtype", "auto"),
    )


class TritonPythonModel:
    def initialize(self, args):
        model_args = ModelArgs(args)
        self.responses = ResponseThread(poll_interval_s=0.02, merge=merge_chunks)
        runner = _runner(model_args)
        self.engine = Engine(
            runner,
            max_batch_size=model_args.int("max_batch_size", 8),
            max_queue_size=model_args.int("max_queue_size", 256),
            max_seq_len=model_args.int("max_seq_len", 0) or None,
            max_num_tokens=model_args.int("max_num_tokens", 8192),
            observer=EngineMetrics(pb_utils, args["model_name"]),
            num_threads=model_args.int("num_threads", 0),
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
