"""The in-process Triton host against a real in-process Triton: the sidecar's behaviours.

Runs where the official ``tritonserver`` API loads (the GPU image, Python 3.12;
``scripts/gpu_smoke.sh`` runs this module there). Elsewhere the whole module is
skipped with the import error: the cp312 wheel needs GLIBCXX_3.4.32, which Debian
12 lacks (DESIGN.md).
"""

from __future__ import annotations

import asyncio

import pytest

from serve.triton.select import in_process_unavailable_reason

REASON = in_process_unavailable_reason()
if REASON is not None:
    pytest.skip(f"in-process Triton API unavailable: {REASON}", allow_module_level=True)

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from serve.triton.host import GenerationError  # noqa: E402
from serve.triton.in_process import InProcessHost  # noqa: E402
from serve.triton.requests import GenerateParams  # noqa: E402
from tests.integration.test_inflight_batching import wait_for  # noqa: E402
from tests.reference import hf_greedy  # noqa: E402
from tritonllm import contract  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def host(built_repository):
    # One in-process server per test process: a second one would share the Python
    # backend's shared-memory names and the metrics registry with the first.
    host = InProcessHost(built_repository).start()
    yield host
    host.stop()


def collect(host, params, limit=None):
    """Run ``generate`` in a fresh event loop; stop reading after ``limit`` chunks."""

    async def scenario():
        chunks = []
        async for chunk in host.generate(params):
            chunks.append(chunk)
            if limit is not None and len(chunks) >= limit:
                break
        return chunks

    return asyncio.run(scenario())


def engine_metrics(host) -> dict[str, float]:
    text = asyncio.run(host.metrics())
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("tritonllm_engine")
    }


@pytest.mark.parametrize("max_tokens", [3, 40])
def test_chunks_join_into_generate_and_the_last_gives_the_reason(
    host, tokenizer, hf_model, max_tokens
):
    chunks = collect(host, GenerateParams("Where is the river?", max_tokens))
    expected = hf_greedy(hf_model, tokenizer, "Where is the river?", max_tokens)
    assert "".join(c.text for c in chunks) == tokenizer.decode(expected, skip_special_tokens=True)
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].text == ""
    assert chunks[-1].num_output_tokens == len(expected)
    assert chunks[-1].finish_reason == ("length" if len(expected) == max_tokens else "stop")


def test_triton_errors_arrive_typed_with_their_message(host):
    with pytest.raises(GenerationError, match="max_tokens must be > 0") as info:
        collect(host, GenerateParams("The cat", 0))
    assert info.value.kind == GenerationError.INVALID
    assert collect(host, GenerateParams("The cat", 2))[-1].num_output_tokens == 2


def test_abandoning_a_generation_frees_the_engine(host):
    counter = "tritonllm_engine_generated_tokens_total"
    before = engine_metrics(host)[counter]
    # min_tokens keeps the model writing: 480 tokens unless it is stopped.
    chunks = collect(host, GenerateParams("The cat", 480, min_tokens=480), limit=3)
    assert len(chunks) == 3
    wait_for(lambda: engine_metrics(host)["tritonllm_engine_running_sequences"] == 0, 10)
    wait_for(lambda: engine_metrics(host)[counter] > before)
    assert engine_metrics(host)[counter] - before < 100


def test_metrics_and_the_repository_index(host):
    metrics = asyncio.run(host.metrics())
    assert "nv_inference_request_success" in metrics
    assert "tritonllm_engine_generated_tokens_total" in metrics
    assert asyncio.run(host.model_index()) == {m: "READY" for m in contract.MODELS}
    assert host._engine_step("ensemble") == "tensorrt_llm"


def test_unload_and_load_a_model(host):
    asyncio.run(host.unload_model(contract.ENSEMBLE))
    assert asyncio.run(host.model_index())[contract.ENSEMBLE] == "UNAVAILABLE"
    assert not asyncio.run(host.is_ready())
    asyncio.run(host.load_model(contract.ENSEMBLE))
    assert asyncio.run(host.is_ready())
    assert collect(host, GenerateParams("The cat", 2))[-1].num_output_tokens == 2


def test_readiness_follows_the_server(host):
    # Last in this module: it stops the shared server (the fixture's stop is a no-op then).
    assert asyncio.run(host.is_ready())
    host.stop()
    assert not asyncio.run(host.is_ready())
    with pytest.raises(GenerationError, match="not running") as info:
        collect(host, GenerateParams("The cat", 2))
    assert info.value.retryable
