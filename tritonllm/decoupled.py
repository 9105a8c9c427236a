"""A decoupled engine model's Python-backend side, shared by the tensorrt_llm adapters.

``model_repository/tensorrt_llm/1/model.py`` (the torch and null engines) and
``llmapi.py`` (TensorRT-LLM's PyTorch backend) differ only in the engine they build;
both take requests, stop them by id, and answer through the response thread here.
``pb_utils`` is passed in: it exists only inside Triton's Python stub.
"""

from __future__ import annotations

import faulthandler

from tritonllm.engine.scheduler import EngineBusy, is_final_chunk, merge_chunks
from tritonllm.engine.tensors import chunk_to_tensors, is_stop_request, to_generation_request
from tritonllm.response_thread import ResponseThread
from tritonllm.tokenization import InvalidRequest
from tritonllm.triton_errors import triton_error


class TritonSink:
    """A request's response sender, written to by the engine through the response thread."""

    def __init__(self, pb_utils, request, sender, generation_request, responses: ResponseThread):
        self.cancelled = False  # set by the response thread's polling
        self._pb_utils = pb_utils
        self._request = request
        self._sender = sender
        self._generation_request = generation_request
        self._responses = responses
        # Only what the caller asked for: Triton would drop the rest inside send(), with
        # the GIL released, and dropping a tensor there frees its numpy array without
        # the GIL, which corrupts the stub's heap (python_backend's ResponseSender::Send
        # prunes unrequested outputs after gil_scoped_release; under load the stub died
        # of SIGSEGV in pymalloc). It also spares copying tensors nobody reads to Triton.
        self._wanted = frozenset(request.requested_output_names())

    # The engine's side (tritonllm.engine.scheduler.ResponseSink): never blocks.

    def send(self, chunk) -> None:
        self._responses.send(self, chunk)

    def fail(self, message: str, code: str = "INTERNAL") -> None:
        self._responses.send(self, triton_error(self._pb_utils, message, code))

    def is_cancelled(self) -> bool:
        return self.cancelled

    # The response thread's side: the round trips to the server.

    def deliver(self, item) -> bool:
        pb = self._pb_utils
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if isinstance(item, pb.TritonError):
            self._sender.send(pb.InferenceResponse(error=item), flags=final)
            return True
        chunk = item
        # A stream's end (an EOS) carries the counts, with no tokens: the end token is
        # counted but not returned, so the last counts are the final response's.
        tensors = chunk_to_tensors(chunk, self._generation_request)
        # Held until send() returns, so that no tensor's last reference goes inside it.
        outputs = [
            pb.Tensor(name, value) for name, value in tensors.items() if name in self._wanted
        ]
        self._sender.send(
            pb.InferenceResponse(output_tensors=outputs), flags=final if chunk.finished else 0
        )
        return chunk.finished

    def poll_cancelled(self) -> bool:
        return self._request.is_cancelled()


def response_thread(model_args) -> ResponseThread:
    """The model's response thread: what it finds queued for a request leaves as one
    response, and under load the requests share the config's ``stream_chunks_per_s``
    (0 or absent: none; ``tritonllm.response_thread``)."""
    return ResponseThread(
        poll_interval_s=0.02,
        merge=merge_chunks,
        chunks_per_s=float(model_args.str("stream_chunks_per_s", "0")),
        is_final=is_final_chunk,
    )


def print_stacks_on_crash() -> None:
    """A native crash of the stub (SIGSEGV, SIGBUS, SIGABRT) prints every thread's Python
    stack to the stub's stderr, which is Triton's log. Otherwise the stub dies without a
    word, and Triton keeps calling its model ready (serve/engines/triton/launcher.py:dead_stubs).
    ``PYTHONFAULTHANDLER`` does nothing here: the stub's interpreter is embedded."""
    faulthandler.enable(all_threads=True)


class DecoupledEngineModel:
    """``execute`` and ``finalize`` of a Triton Python model over ``self.engine``
    (``submit``, ``cancel``, ``shutdown``) and ``self.responses``, which a subclass's
    ``initialize`` sets with ``self.pb_utils``."""

    pb_utils = None
    engine = None
    responses: ResponseThread

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request) -> None:
        pb = self.pb_utils

        def get(name):
            tensor = pb.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        sender = request.get_response_sender()
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sink = None
        try:
            if is_stop_request(get):
                self.engine.cancel(request.request_id())
                sender.send(flags=final)
                return
            generation_request = to_generation_request(request.request_id(), get)
            sink = TritonSink(pb, request, sender, generation_request, self.responses)
            self.responses.watch(sink)
            self.engine.submit(generation_request, sink)
        except (InvalidRequest, EngineBusy) as exc:
            if sink is not None:
                self.responses.unwatch(sink)
            code = "UNAVAILABLE" if isinstance(exc, EngineBusy) else "INVALID_ARG"
            sender.send(pb.InferenceResponse(error=triton_error(pb, str(exc), code)), flags=final)

    def finalize(self) -> None:
        self.engine.shutdown()
        self.responses.close()
