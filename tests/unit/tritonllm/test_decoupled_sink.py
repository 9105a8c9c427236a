"""The engine model's response sink hands Triton only the outputs its caller asked for.

Triton's Python backend drops unrequested outputs inside ``response_sender.send`` with
the GIL released, freeing their numpy arrays without it; under load that corrupted the
stub's heap (SIGSEGV in pymalloc). So no unrequested tensor may reach ``send``.
"""

from __future__ import annotations

from types import SimpleNamespace

from tritonllm import contract
from tritonllm.decoupled import TritonSink
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.scheduler import GenerationChunk


class FakeSender:
    def __init__(self):
        self.sent = []  # (output names, flags)

    def send(self, response, flags=0):
        self.sent.append(([t.name for t in response.output_tensors], flags))


class FakeRequest:
    def __init__(self, requested):
        self.requested = requested

    def requested_output_names(self):
        return list(self.requested)

    def is_cancelled(self):
        return False


pb_utils = SimpleNamespace(
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
    TritonError=type("TritonError", (Exception,), {}),
    Tensor=lambda name, value: SimpleNamespace(name=name, value=value),
    InferenceResponse=lambda output_tensors=(), error=None: SimpleNamespace(
        output_tensors=output_tensors, error=error
    ),
)


def chunk(finished: bool) -> GenerationChunk:
    return GenerationChunk(
        token_ids=[5, 6],
        log_probs=[-0.1, -0.2],
        cum_log_prob=-0.3,
        num_input_tokens=3,
        num_output_tokens=2,
        finished=finished,
        finish_reason="stop" if finished else None,
        num_cached_tokens=0,
    )


def deliver(requested: list[str], item: GenerationChunk):
    sender = FakeSender()
    request = GenerationRequest(request_id="r", input_ids=(1, 2, 3), max_tokens=4)
    sink = TritonSink(pb_utils, FakeRequest(requested), sender, request, responses=None)
    final = sink.deliver(item)
    return sender.sent, final


def test_only_requested_outputs_reach_the_sender():
    requested = [contract.OUTPUT_IDS.name, contract.SEQUENCE_LENGTH.name]
    sent, final = deliver(requested, chunk(finished=False))
    assert sent == [(requested, 0)] and not final


def test_the_final_response_carries_the_requested_extensions_only():
    requested = [contract.OUTPUT_IDS.name, contract.FINISH_REASON.name]
    sent, final = deliver(requested, chunk(finished=True))
    assert sent == [(requested, 1)] and final
