"""The embeddings model through a real Triton (one per module, started by the sidecar host
a Serve replica uses): parity with sentence-transformers, dynamic batching that keeps
rows apart, errors that leave the server serving."""

from __future__ import annotations

import asyncio
import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from build_engines.embeddings import EmbeddingsOptions
from serve.engines.triton.client import infer_inputs
from serve.engines.triton.sidecar import SidecarHost
from serve.generation import GenerationError
from tests.unit.tritonllm.test_embeddings import SENTENCES, cosine
from tritonllm import contract

pytestmark = pytest.mark.integration

# Sixteen distinct texts for the concurrency test: the same words in other orders and
# lengths, so a row mixed up with another would show.
MANY = [f"{' '.join(SENTENCES[i % 4].split()[: 3 + i % 5])} number {i}" for i in range(16)]


@pytest.fixture(scope="module")
def host(built_embedding_repository):
    host = SidecarHost(built_embedding_repository).start()
    yield host
    host.stop()


@pytest.fixture(scope="module")
def client(host):
    client = grpcclient.InferenceServerClient(host.process.grpc_url)
    yield client
    client.close()


def text_tensor(texts: list[str]) -> dict[str, np.ndarray]:
    return {"text": np.array([[t.encode()] for t in texts], dtype=object)}


def embed(client, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    result = client.infer(contract.EMBEDDINGS, infer_inputs(text_tensor(texts)))
    return result.as_numpy("embedding"), result.as_numpy("num_tokens")


def embed_concurrently(client, requests: list[list[str]]) -> list:
    """Send every request before reading any answer; each answer or its error, in order."""
    answers: queue.Queue = queue.Queue()
    for i, texts in enumerate(requests):
        client.async_infer(
            contract.EMBEDDINGS,
            infer_inputs(text_tensor(texts)),
            callback=lambda result, error, i=i: answers.put((i, result, error)),
        )
    received = [answers.get(timeout=120) for _ in requests]
    by_index = {i: result if error is None else error for i, result, error in received}
    return [by_index[i] for i in range(len(requests))]


def statistics(client) -> dict:
    return client.get_inference_statistics(contract.EMBEDDINGS, as_json=True)["model_stats"][0]


def test_embeddings_equal_sentence_transformers(client, sentence_transformer, sentence_encoder):
    reference = sentence_transformer.encode(SENTENCES, convert_to_numpy=True)
    one_by_one = [embed(client, [s]) for s in SENTENCES]
    vectors = np.concatenate([v for v, _ in one_by_one])
    assert vectors.shape == (len(SENTENCES), 384) and vectors.dtype == np.float32
    assert (cosine(vectors, reference) > 0.9999).all(), cosine(vectors, reference)
    counts = [int(n[0, 0]) for _, n in one_by_one]
    assert counts == sentence_encoder.encode(SENTENCES).num_tokens.tolist()
    assert counts[-1] == 256  # the long text is truncated at max_seq_length
    # One request carrying every text gives the same rows.
    together, _ = embed(client, SENTENCES)
    np.testing.assert_allclose(together, vectors, atol=1e-5)


def test_similar_sentences_score_higher_than_unrelated_ones(client):
    (cat, cat2, stocks), _ = embed(client, SENTENCES[:3])
    assert cosine(cat, cat2)[0] > 0.8 > cosine(cat, stocks)[0] + 0.5


def settled_statistics(client) -> dict:
    """The model's statistics once every answered request is counted.

    Triton counts an execute once it has returned, which is after its responses went
    out: the last batch may show a moment after the client has its answers. With no
    request in flight, counts that hold still for 0.2 s are final."""
    deadline = time.monotonic() + 10
    previous = statistics(client)
    while True:
        time.sleep(0.2)
        now = statistics(client)
        if now["inference_count"] == previous["inference_count"] or time.monotonic() > deadline:
            return now
        previous = now


def test_concurrent_requests_are_batched_and_keep_their_own_rows(client):
    alone = np.concatenate([embed(client, [t])[0] for t in MANY])
    before = settled_statistics(client)
    results = embed_concurrently(client, [[t] for t in MANY])
    together = np.concatenate([r.as_numpy("embedding") for r in results])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    after = settled_statistics(client)
    inferences = int(after["inference_count"]) - int(before["inference_count"])
    executions = int(after["execution_count"]) - int(before["execution_count"])
    assert inferences == len(MANY)
    # Sent all at once, most of them queue while the first runs: Triton merges them.
    assert executions < len(MANY), f"{executions} executions for {inferences} texts"


def test_empty_input_is_a_clear_error_and_the_server_keeps_serving(client):
    with pytest.raises(InferenceServerException, match="text is empty") as info:
        embed(client, [""])
    assert "INVALID_ARGUMENT" in str(info.value.status())
    # In a dynamic batch, the bad request fails alone.
    answers = embed_concurrently(client, [[SENTENCES[0]], [""], [SENTENCES[1]], ["a", ""]])
    assert [isinstance(a, InferenceServerException) for a in answers] == [False, True, False, True]
    expected, _ = embed(client, SENTENCES[:2])
    np.testing.assert_allclose(answers[0].as_numpy("embedding")[0], expected[0], atol=1e-5)
    np.testing.assert_allclose(answers[2].as_numpy("embedding")[0], expected[1], atol=1e-5)


def test_the_sidecar_host_answers_infer(host, client):
    async def scenario():
        try:
            good = await host.infer(contract.EMBEDDINGS, text_tensor(SENTENCES[:2]))
            with pytest.raises(GenerationError, match="text is empty") as empty:
                await host.infer(contract.EMBEDDINGS, text_tensor([""]))
            # More texts than max_batch_size in one request: the caller must split them.
            limit = EmbeddingsOptions().max_batch_size
            too_many = text_tensor(["a"] * (limit + 1))
            with pytest.raises(GenerationError, match=f"batch-size must be <= {limit}") as large:
                await host.infer(contract.EMBEDDINGS, too_many)
            errors = (empty.value, large.value)
            return good, errors, await host.is_ready(contract.EMBEDDINGS)
        finally:
            await host.close()

    outputs, errors, ready = asyncio.run(scenario())
    assert set(outputs) == {"embedding", "num_tokens"}
    assert outputs["embedding"].shape == (2, 384) and outputs["embedding"].dtype == np.float32
    assert outputs["num_tokens"].shape == (2, 1) and outputs["num_tokens"].dtype == np.int32
    expected, counts = embed(client, SENTENCES[:2])
    np.testing.assert_allclose(outputs["embedding"], expected, atol=1e-5)
    assert outputs["num_tokens"].tolist() == counts.tolist()
    assert [e.kind for e in errors] == [GenerationError.INVALID] * 2
    assert ready
