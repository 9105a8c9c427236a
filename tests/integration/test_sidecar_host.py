"""The sidecar Triton host (what a Serve replica runs) against a real Triton."""

from __future__ import annotations

import asyncio

import pytest

from serve.triton.host import GenerationError
from serve.triton.requests import GenerateParams
from serve.triton.sidecar import SidecarHost
from tests.integration.test_inflight_batching import engine_metrics, wait_for
from tests.reference import hf_greedy
from tritonllm import contract

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def host(built_repository):
    host = SidecarHost(built_repository).start()
    yield host
    host.stop()


def collect(host, params, limit=None):
    """Run ``generate`` in a fresh event loop; stop reading after ``limit`` chunks."""

    async def scenario():
        chunks = []
        try:
            async for chunk in host.generate(params):
                chunks.append(chunk)
                if limit is not None and len(chunks) >= limit:
                    break
        finally:
            await host.close()
        return chunks

    return asyncio.run(scenario())


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


def test_triton_errors_arrive_with_their_message(host):
    with pytest.raises(GenerationError, match="max_tokens must be > 0") as info:
        collect(host, GenerateParams("The cat", 0))
    assert info.value.kind == GenerationError.INVALID
    assert collect(host, GenerateParams("The cat", 2))[-1].num_output_tokens == 2


def test_abandoning_a_generation_frees_the_engine(host):
    counter = "tritonllm_engine_generated_tokens_total"
    before = engine_metrics(host.process)[counter]
    # min_tokens keeps the model writing: 480 tokens unless it is stopped.
    chunks = collect(host, GenerateParams("The cat", 480, min_tokens=480), limit=3)
    assert len(chunks) == 3
    wait_for(lambda: engine_metrics(host.process)["tritonllm_engine_running_sequences"] == 0, 10)
    wait_for(lambda: engine_metrics(host.process)[counter] > before)
    assert engine_metrics(host.process)[counter] - before < 100


def test_readiness_follows_the_server(built_repository):
    async def ready(h):
        try:
            return await h.is_ready()
        finally:
            await h.close()

    host = SidecarHost(built_repository).start()
    assert asyncio.run(ready(host))
    host.stop()
    assert not asyncio.run(ready(host))


def test_metrics_and_the_repository_index(host):
    async def scenario():
        try:
            step = await host._engine_step("ensemble")
            return await host.metrics(), await host.model_index(), step
        finally:
            await host.close()

    metrics, index, engine_step = asyncio.run(scenario())
    assert "nv_inference_request_success" in metrics
    assert "tritonllm_engine_generated_tokens_total" in metrics
    assert index == {m: "READY" for m in contract.MODELS}
    assert engine_step == "tensorrt_llm"
