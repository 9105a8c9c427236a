"""The in-process host's error mapping, on any machine.

The real host runs in tests/integration/test_triton_hosts.py where ``tritonserver``
loads. Here a stand-in module provides only the exception classes the API exports
(``tritonserver/__init__.py``: TritonError and its typed subclasses): the mapping
from those types to GenerationError is this project's code, and that is under test.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from serve.engines.triton.select import in_process_unavailable_reason
from serve.generation import GenerationError


@pytest.fixture
def in_process(monkeypatch):
    api = types.ModuleType("tritonserver")
    api.TritonError = type("TritonError", (Exception,), {})
    for name in ("InvalidArgumentError", "UnavailableError", "InternalError"):
        setattr(api, name, type(name, (api.TritonError,), {}))
    if in_process_unavailable_reason() is None:
        pytest.skip("the real tritonserver loads here: the integration tests cover it")
    monkeypatch.setitem(sys.modules, "tritonserver", api)
    monkeypatch.delitem(sys.modules, "serve.engines.triton.in_process", raising=False)
    module = importlib.import_module("serve.engines.triton.in_process")
    yield module, api
    sys.modules.pop("serve.engines.triton.in_process", None)


def test_typed_errors_map_to_their_kind(in_process):
    module, api = in_process
    invalid = module.from_triton_error(api.InvalidArgumentError("unexpected input 'x'"))
    assert (invalid.kind, str(invalid)) == (GenerationError.INVALID, "unexpected input 'x'")
    busy = module.from_triton_error(api.UnavailableError("Timeout before ready"))
    assert busy.kind == GenerationError.UNAVAILABLE and busy.retryable


def test_the_response_appended_to_args_stays_out_of_the_message(in_process):
    module, api = in_process
    error = api.InternalError("boom")
    error.args += (object(),)  # what the API does to an error raised from a response
    assert str(module.from_triton_error(error)) == "boom"


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        # TensorRT-LLM's backend sends every refusal as INTERNAL (model_instance_state.cc,
        # sendEnqueueResponse): the words decide, with the sidecar's classifier.
        ("prompt of 5000 tokens exceeds max_input_len 4096", GenerationError.INVALID),
        ("the engine queue is full (256 waiting)", GenerationError.UNAVAILABLE),
        ("CUDA error: an illegal memory access", GenerationError.INTERNAL),
    ],
)
def test_internal_errors_are_read_like_the_sidecar_reads_them(in_process, message, kind):
    module, api = in_process
    assert module.from_triton_error(api.InternalError(message)).kind == kind
