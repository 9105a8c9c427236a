"""In-flight batching through the real Triton server: equality, seeds, cancellation, limits."""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from serve.engines.triton.client import Stream, ensemble_values, generate
from tests.integration.repositories import repository_with_limits
from tests.reference import hf_greedy
from tests.unit.tritonllm.engine.test_engine import SIXTEEN_PROMPTS
from tritonllm import contract

pytestmark = pytest.mark.integration


def engine_metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        text = r.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("tritonllm_engine")
    }


def step_statistics(server, model: str) -> dict[str, int]:
    """Triton's counters of one model: inferences (batch rows) and executions."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    finally:
        client.close()
    return {key: int(stats.get(key, 0)) for key in ("inference_count", "execution_count")}


def wait_for(condition, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sixteen_staggered_requests_each_equal_generate_alone(triton, tokenizer, hf_model):
    results: dict[int, str] = {}

    def run(i: int, prompt: str, max_tokens: int) -> None:
        results[i] = generate(
            triton.grpc_url,
            prompt,
            max_tokens,
            stream=i % 2 == 0,
            exclude_input_in_output=True,
            end_id=0,
        ).text

    before = step_statistics(triton, contract.POSTPROCESSING)
    threads = []
    for i, prompt in enumerate(SIXTEEN_PROMPTS):
        max_tokens = 6 + (i * 7) % 29
        threads.append(threading.Thread(target=run, args=(i, prompt, max_tokens)))
        threads[-1].start()
        time.sleep(0.01 * (i % 3))
    for thread in threads:
        thread.join(120)
    for i, prompt in enumerate(SIXTEEN_PROMPTS):
        expected = hf_greedy(hf_model, tokenizer, prompt, 6 + (i * 7) % 29, end_id=0)
        assert results[i] == tokenizer.decode(expected, skip_special_tokens=True), prompt
    # Postprocessing's dynamic batcher merged chunks of different sequences (and shapes:
    # streamed and whole) into shared executes, and every text above still came out right.
    after = step_statistics(triton, contract.POSTPROCESSING)
    inferences = after["inference_count"] - before["inference_count"]
    assert after["execution_count"] - before["execution_count"] < inferences


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(triton):
    seeded = dict(temperature=1.2, top_p=0.9, top_k=50, seed=99, exclude_input_in_output=True)
    alone = generate(triton.grpc_url, "The robot", 30, end_id=0, **seeded).text
    # min_tokens keeps the neighbours running while "busy" runs (CI once saw them all
    # finish before the poll below caught three of them at once).
    long = {"end_id": 0, "min_tokens": 200}
    neighbours = [
        threading.Thread(target=generate, args=(triton.grpc_url, p, 200), kwargs=long)
        for p in SIXTEEN_PROMPTS[:6]
    ]
    for thread in neighbours:
        thread.start()
    wait_for(lambda: engine_metrics(triton)["tritonllm_engine_running_sequences"] >= 3)
    busy = generate(triton.grpc_url, "The robot", 30, end_id=0, **seeded).text
    for thread in neighbours:
        thread.join(60)
    assert busy == alone


def test_log_probs_are_the_models_own(triton, tokenizer, hf_model):
    prompt = "Where is the river?"
    result = generate(
        triton.grpc_url,
        prompt,
        12,
        end_id=0,
        return_log_probs=True,
        exclude_input_in_output=True,
        return_num_input_tokens=True,
    )
    out = result.responses[-1]
    log_probs = out["output_log_probs"].reshape(-1)
    generated = hf_greedy(hf_model, tokenizer, prompt, 12, end_id=0)
    prompt_ids = tokenizer.encode(prompt)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + generated])).logits[0]
    expected = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], -1)
    expected = expected[torch.arange(len(generated)), torch.tensor(generated)]
    np.testing.assert_allclose(log_probs, expected.numpy(), rtol=1e-4, atol=1e-4)
    assert out["cum_log_probs"].reshape(-1)[0] == pytest.approx(float(expected.sum()), abs=1e-3)
    assert int(out["num_input_tokens"].reshape(-1)[0]) == len(prompt_ids)


def test_without_return_log_probs_they_are_zero(triton):
    out = generate(triton.grpc_url, "The cat", 5, end_id=0).responses[-1]
    assert not out["output_log_probs"].any() and not out["cum_log_probs"].any()


def tensorrt_llm_values(tokenizer, prompt: str, max_tokens: int, **flags) -> dict:
    ids = np.array([tokenizer.encode(prompt)], dtype=np.int32)
    values = {
        "input_ids": ids,
        "input_lengths": np.array([[ids.shape[1]]], dtype=np.int32),
        "request_output_len": np.array([[max_tokens]], dtype=np.int32),
    }
    values.update({k: np.array([[v]], dtype=np.bool_) for k, v in flags.items()})
    return values


def generated_while(server, action) -> float:
    """Tokens the engine generated while ``action`` ran, once the batch is empty again."""
    counter = "tritonllm_engine_generated_tokens_total"
    wait_for(lambda: engine_metrics(server)["tritonllm_engine_running_sequences"] == 0)
    before = engine_metrics(server)[counter]
    action()
    wait_for(lambda: engine_metrics(server)["tritonllm_engine_running_sequences"] == 0, 10)
    time.sleep(0.5)  # the engine's metrics flush interval
    return engine_metrics(server)[counter] - before


def long_tensorrt_llm_request(tokenizer) -> dict:
    values = tensorrt_llm_values(tokenizer, "The cat", 480, streaming=True)
    values["end_id"] = np.array([[0]], dtype=np.int32)  # no EOS: it would run all 480
    return values


def test_a_client_that_disconnects_frees_its_slot(triton, tokenizer):
    def disconnect_after_three_tokens():
        stream = Stream(triton.grpc_url)
        stream.send("tensorrt_llm", long_tensorrt_llm_request(tokenizer), uuid.uuid4().hex)
        responses = stream.responses()
        for _ in range(3):
            next(responses)
        stream.close(cancel_requests=True)  # Triton marks the request cancelled

    assert generated_while(triton, disconnect_after_three_tokens) < 50  # not 480
    assert generate(triton.grpc_url, "Hello", 4).text


def send_stop(url: str, tokenizer, request_id: str) -> None:
    with Stream(url) as control:
        control.send("tensorrt_llm", tensorrt_llm_values(tokenizer, "x", 1, stop=True), request_id)
        assert [r.get_response().outputs for r in control.responses(10)] == [[]]


def test_the_stop_input_ends_a_running_request(triton, tokenizer):
    def stop_after_one_token():
        request_id = uuid.uuid4().hex
        with Stream(triton.grpc_url) as stream:
            stream.send("tensorrt_llm", long_tensorrt_llm_request(tokenizer), request_id)
            responses = stream.responses()
            next(responses)
            send_stop(triton.grpc_url, tokenizer, request_id)
            list(responses)  # the final response comes at once

    assert generated_while(triton, stop_after_one_token) < 50


def test_an_ensemble_request_is_stopped_by_its_request_id(triton, tokenizer):
    # Triton 2.51's ensemble does not pass a client's cancellation on to the
    # tensorrt_llm step; the ensemble's request id reaches it, so a front end
    # stops a disconnected client's generation with the stop input.
    def stop_after_three_chunks():
        request_id = uuid.uuid4().hex
        with Stream(triton.grpc_url) as stream:
            values = ensemble_values("The cat", 480, stream=True, end_id=0)
            stream.send("ensemble", values, request_id)
            responses = stream.responses()
            for _ in range(3):
                next(responses)
            send_stop(triton.grpc_url, tokenizer, request_id)
            list(responses)

    assert generated_while(triton, stop_after_three_chunks) < 50


@pytest.fixture(scope="module")
def tight_triton(checkpoint_dir, tmp_path_factory):
    """The same checkpoint under tight limits: one slot, three queued requests, 16-token
    steps (longer prompts prefilled in chunks)."""
    from serve.engines.triton.launcher import TritonProcess

    repository = repository_with_limits(
        checkpoint_dir,
        tmp_path_factory.mktemp("tight") / "model_repository",
        *("--max-batch-size", "1", "--max-queue-size", "3", "--max-num-tokens", "16"),
        "--enable-chunked-context",
    )
    with TritonProcess(repository).start(timeout_s=180) as server:
        yield server


def test_past_the_queue_bound_requests_are_busy_and_the_server_serves_on(tight_triton):
    url = tight_triton.grpc_url
    running = threading.Thread(target=generate, args=(url, "The cat", 150), kwargs={"end_id": 0})
    running.start()
    wait_for(lambda: engine_metrics(tight_triton)["tritonllm_engine_running_sequences"] == 1)
    queued = [threading.Thread(target=generate, args=(url, "Hello", 4)) for _ in range(3)]
    for thread in queued:
        thread.start()
    wait_for(lambda: engine_metrics(tight_triton)["tritonllm_engine_queued_requests"] == 3)
    with pytest.raises(InferenceServerException, match="queue is full"):
        generate(url, "Hi", 4)
    running.join(60)
    for thread in queued:
        thread.join(60)
    assert generate(url, "Hi", 4).text


def test_a_full_engine_admits_the_ensemble_s_priority_first(tight_triton, tokenizer):
    """The contract's ``priority`` through the ensemble: queued behind a running request,
    the urgent one (lower) starts first though it came last."""
    url, started = tight_triton.grpc_url, {}

    def send(name: str, priority: int) -> None:
        with Stream(url) as stream:
            values = ensemble_values("Hello", 2, stream=True, priority=priority)
            stream.send(contract.ENSEMBLE, values, uuid.uuid4().hex)
            for result in stream.responses(60):
                if result.get_response().outputs:
                    started.setdefault(name, time.monotonic())

    def queued_requests() -> float:
        return engine_metrics(tight_triton)["tritonllm_engine_queued_requests"]

    long_id = uuid.uuid4().hex  # runs until stopped, once the others have queued
    running = threading.Thread(
        target=generate, args=(url, "The cat", 480), kwargs={"end_id": 0, "request_id": long_id}
    )
    running.start()
    wait_for(lambda: engine_metrics(tight_triton)["tritonllm_engine_running_sequences"] == 1)
    queued = []
    for name, priority in [("later", 7), ("default", 0), ("urgent", -1)]:
        queued.append(threading.Thread(target=send, args=(name, priority)))
        queued[-1].start()
        count = len(queued)  # each queued before the next is sent: their order is known
        wait_for(lambda count=count: queued_requests() == count)
    send_stop(url, tokenizer, long_id)
    running.join(60)
    for thread in queued:
        thread.join(60)
    assert sorted(started, key=started.get) == ["urgent", "default", "later"]


def test_a_prompt_over_the_step_budget_is_prefilled_in_chunks(tight_triton, triton):
    """With chunked context a 16-token step budget takes a longer prompt over several
    steps, with the answer of an engine that prefills it at once (the default build)."""
    prompt = "The dog and the cat sat near the window " * 3
    chunked = generate(tight_triton.grpc_url, prompt, 12, end_id=0)
    assert chunked.text == generate(triton.grpc_url, prompt, 12, end_id=0).text


def test_the_engine_counts_its_tokens(tight_triton):
    before = engine_metrics(tight_triton)
    result = generate(tight_triton.grpc_url, "Hi", 7, end_id=0, return_num_output_tokens=True)
    assert int(result.responses[-1]["num_output_tokens"].reshape(-1)[0]) == 7
    wait_for(
        lambda: (
            engine_metrics(tight_triton)["tritonllm_engine_generated_tokens_total"]
            >= before["tritonllm_engine_generated_tokens_total"] + 7
        )
    )


def test_a_repeated_prefix_is_served_from_the_prefix_cache_and_counted(triton):
    """The default build caches prefixes; Triton's endpoint shows vLLM's two counters."""

    def counters():
        with urllib.request.urlopen(f"http://127.0.0.1:{triton.metrics_port}/metrics") as r:
            families = text_string_to_metric_families(r.read().decode())
            samples = {s.name: s.value for f in families for s in f.samples}
        return samples["vllm:prefix_cache_queries_total"], samples["vllm:prefix_cache_hits_total"]

    system = "The robot writes a long letter to the old town every morning by the window. " * 3
    first = generate(triton.grpc_url, system + "Where?", 8, end_id=0, exclude_input_in_output=True)
    queried, hits = counters()
    again = generate(triton.grpc_url, system + "Why?", 8, end_id=0, exclude_input_in_output=True)
    wait_for(lambda: counters()[0] > queried)
    new_queries, new_hits = (
        now - before for now, before in zip(counters(), (queried, hits), strict=True)
    )
    assert new_hits >= 48 and new_hits < new_queries  # the shared system text, not the rest
    assert first.text and again.text
