"""The GPU path under pytest (the steps of scripts/gpu_smoke.sh, one test each).

Skipped with the reason where torch sees no CUDA device; the TensorRT-LLM and
in-process tests also where their packages do not load (they say which).
"""

from __future__ import annotations

import pytest

from bench.gpu_smoke import Skip, Smoke

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda)"),
]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    smoke = Smoke(tmp_path_factory.mktemp("gpu-smoke"))
    smoke.torch_engine()  # the torch repository the other steps reuse
    return smoke


def run(step):
    try:
        return step()
    except Skip as skip:
        pytest.skip(str(skip))


def test_torch_engine_on_cuda_equals_generate(smoke):
    assert smoke.sidecar_text  # torch_engine() compared it with generate() on the GPU


def test_in_process_host_answers_like_the_sidecar(smoke):
    assert "same text as the sidecar" in run(smoke.in_process)


def test_tiny_trtllm_engine_builds_once_and_answers(smoke):
    assert "rebuild skipped" in run(smoke.trtllm)
