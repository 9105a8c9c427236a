"""Both Triton hosts of a replica against a real Triton, with the same test cases.

The sidecar runs everywhere. The in-process host runs where the official
``tritonserver`` API loads (the GPU image, Python 3.12; ``scripts/gpu_smoke.sh``
runs this module there); elsewhere its cases are skipped with the import error (the
cp312 wheel needs GLIBCXX_3.4.32, which Debian 12 lacks: DESIGN.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from contextlib import aclosing
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve.engines.triton.requests import EnsembleRoute
from serve.engines.triton.select import in_process_unavailable_reason
from serve.engines.triton.sidecar import SidecarHost
from serve.engines.triton.steps import ReplicaSteps
from serve.generation import GenerateParams, GenerationError
from tests.integration.test_inflight_batching import wait_for
from tests.reference import counted, hf_greedy
from tritonllm import contract

pytestmark = pytest.mark.integration
IN_PROCESS_REASON = in_process_unavailable_reason()


def start_host(kind: str, repository):
    if kind == "in_process":
        if IN_PROCESS_REASON is not None:
            pytest.skip(f"in-process Triton API unavailable: {IN_PROCESS_REASON}")
        from serve.engines.triton.in_process import InProcessHost

        return InProcessHost(repository).start()
    from serve.engines.triton.sidecar import SidecarHost

    return SidecarHost(repository).start()


class RoutedHost:
    """A host whose generations take ``route`` (the replica's own steps, say) instead of
    the ensemble; everything else is the host's."""

    def __init__(self, host, route):
        self._host, self.route = host, route

    def __getattr__(self, name):
        return getattr(self._host, name)

    def generate(self, params, adapter=None):
        return self._host.generate(params, self.route, adapter)


# Each host, with its generations through the ensemble and through the replica's own
# tokenize and detokenize steps (serve/engines/triton/steps.py): the same cases hold for both.
@pytest.fixture(
    scope="module",
    params=["sidecar-ensemble", "sidecar-replica", "in_process-ensemble", "in_process-replica"],
)
def host(request, built_repository):
    # One in-process server per test process: a second one would share the Python
    # backend's shared-memory names and the metrics registry with the first.
    kind, pipeline = request.param.split("-")
    host = start_host(kind, built_repository)
    if pipeline == "replica":
        host = RoutedHost(host, ReplicaSteps.load(built_repository, contract.ENSEMBLE))
    yield host
    host.stop()


def run(host, coroutine_fn):
    """Run ``coroutine_fn()`` in a fresh event loop (the sidecar keeps a gRPC channel
    per loop, closed here)."""

    async def scenario():
        try:
            return await coroutine_fn()
        finally:
            close = getattr(host, "close", None)
            if close is not None:
                await close()

    return asyncio.run(scenario())


def collect(host, params, limit=None, adapter=None):
    """``generate``'s chunks; stop reading after ``limit`` of them."""

    async def chunks():
        got = []
        # Closed where it is abandoned, as Serve does when a client goes away (a
        # generator left to the garbage collector would be closed after the channel).
        async with aclosing(host.generate(params, adapter=adapter)) as stream:
            async for chunk in stream:
                got.append(chunk)
                if limit is not None and len(got) >= limit:
                    break
        return got

    return run(host, chunks)


def engine_metrics(host) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(run(host, host.metrics))
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
    assert chunks[-1].num_output_tokens == counted(expected, max_tokens)
    assert chunks[-1].finish_reason == ("length" if len(expected) == max_tokens else "stop")
    assert all(c.text or c.token_ids for c in chunks[:-1])
    if isinstance(getattr(host, "_host", host), SidecarHost) and len(expected) == max_tokens:
        # Triton's final response holds the last token: it and the reason are one chunk.
        assert chunks[-1].token_ids


def test_a_stop_word_on_the_last_allowed_token_ends_with_the_engines_stop(host, tokenizer):
    """The engine says why it stopped (the contract's finish_reason): counting tokens
    against max_tokens, as for an engine that does not, would read "length" here."""
    prompt = "Where is the river?"
    free = collect(host, GenerateParams(prompt, 12, ignore_eos=True))
    ids = [token for chunk in free for token in chunk.token_ids]
    for n in range(3, len(ids) + 1):  # a token whose text alone tokenizes back to it
        word = tokenizer.decode([ids[n - 1]])
        alone = tokenizer.encode(word, add_special_tokens=False) == [ids[n - 1]]
        if word.strip() and alone and ids[n - 1] not in ids[: n - 1]:
            break
    else:
        pytest.skip(f"no token of {ids} makes a stop word of its own")
    chunks = collect(host, GenerateParams(prompt, n, ignore_eos=True, stop=(word,)))
    assert chunks[-1].num_output_tokens == n
    assert chunks[-1].finish_reason == "stop"
    unstopped = collect(host, GenerateParams(prompt, n, ignore_eos=True))
    assert unstopped[-1].finish_reason == "length"


def test_the_replica_steps_answer_as_the_ensemble(host, built_repository, tokenizer):
    """Token for token, text for text, with log probabilities, alternatives and a stop
    string: the replica's own tokenizing and detokenizing against Triton's ensemble."""
    steps = ReplicaSteps.load(built_repository, contract.ENSEMBLE)
    prompt = "The cat sat on the"
    # The end token and the next BOS: special tokens, not text.
    free = collect(host, GenerateParams(prompt, 24, ignore_eos=True))
    stop = stop_word_after(tokenizer, [t for c in free for t in c.token_ids], 11)
    params = GenerateParams(
        prompt,
        24,
        ignore_eos=True,
        stop=(stop,),
        return_log_probs=True,
        top_log_probs=3,
        request_id="same",
    )

    triton = host._host if isinstance(host, RoutedHost) else host

    async def answer(route):
        return [chunk async for chunk in triton.generate(params, route)]

    def whole(chunks):  # how the engine's steps split the tokens into responses varies
        return {
            "text": "".join(c.text for c in chunks),
            "token_ids": [t for c in chunks for t in c.token_ids],
            "log_probs": [p for c in chunks for p in c.token_log_probs],
            "top": [t for c in chunks for t in c.top_log_probs],
            # The last chunk's own tokens too (a busy machine splits the steps otherwise).
            "last": dataclasses.replace(
                chunks[-1], text="", token_ids=(), token_log_probs=(), top_log_probs=()
            ),
        }

    through_ensemble = whole(run(host, lambda: answer(EnsembleRoute())))
    assert whole(run(host, lambda: answer(steps))) == through_ensemble
    free_text = "".join(c.text for c in free)
    kept = free_text[: free_text.index(stop) + len(stop)]  # the engine keeps the stop word
    assert through_ensemble["text"] == kept and through_ensemble["last"].finish_reason == "stop"
    assert len(through_ensemble["top"]) == len(through_ensemble["token_ids"]) > 10


def stop_word_after(tokenizer, ids: list[int], start: int) -> str:
    """The text of the first token from ``start`` on that makes a stop word of its own:
    a word that tokenizes back to the token alone and does not appear earlier (the
    greedy answer depends on the machine the default model was trained on)."""
    for n in range(start, len(ids)):
        word = tokenizer.decode([ids[n]])
        alone = tokenizer.encode(word, add_special_tokens=False) == [ids[n]]
        if word.strip().isalpha() and alone and word not in tokenizer.decode(ids[:n]):
            return word
    pytest.skip(f"no token of {ids} from {start} on makes a stop word of its own")


def test_triton_errors_arrive_with_their_kind_and_message(host):
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


def test_concurrent_generations_keep_their_own_answers_errors_and_ends(host, tokenizer, hf_model):
    """The sidecar carries all the generations of an event loop on one gRPC stream and
    hands each response to its request by id: side by side, each request gets exactly
    its own answer, an engine error reaches only its own request, and a caller that
    goes away leaves the others streaming."""
    prompts = {"Where is the river?": 5, "The cat": 17, "Tell me about the sea.": 30}

    async def answer(params: GenerateParams, limit: int | None = None):
        chunks = []
        async with aclosing(host.generate(params)) as stream:
            async for chunk in stream:
                chunks.append(chunk)
                if limit is not None and len(chunks) == limit:
                    break
        return chunks

    async def side_by_side():
        return await asyncio.gather(
            *(answer(GenerateParams(p, n)) for p, n in prompts.items()),
            answer(GenerateParams("The cat", 10**7)),  # the engine refuses it
            answer(GenerateParams("The cat", 480, min_tokens=480), limit=2),  # left
            return_exceptions=True,
        )

    *answers, refused, left = run(host, side_by_side)
    for (prompt, max_tokens), chunks in zip(prompts.items(), answers, strict=True):
        expected = hf_greedy(hf_model, tokenizer, prompt, max_tokens)
        assert "".join(c.text for c in chunks) == tokenizer.decode(
            expected, skip_special_tokens=True
        )
        assert chunks[-1].num_output_tokens == counted(expected, max_tokens)
        assert chunks[-1].finish_reason is not None
    assert isinstance(refused, GenerationError) and refused.kind == GenerationError.INVALID
    assert "exceeds" in str(refused)
    assert len(left) == 2
    wait_for(lambda: engine_metrics(host)["tritonllm_engine_running_sequences"] == 0, 10)


def test_metrics_and_the_repository_index(host):
    metrics = run(host, host.metrics)
    assert "nv_inference_request_success" in metrics
    assert "tritonllm_engine_generated_tokens_total" in metrics
    assert run(host, host.model_index) == {m: "READY" for m in contract.MODELS}


def test_unload_and_load_a_model(host):
    # After test_abandoning_a_generation_frees_the_engine: an abandoned request must not
    # stay in flight in the ensemble, or this unload would wait for it forever.
    run(host, lambda: host.unload_model(contract.ENSEMBLE))
    wait_for(lambda: run(host, host.model_index)[contract.ENSEMBLE] == "UNAVAILABLE", 30)
    assert not run(host, host.is_ready)
    run(host, lambda: host.load_model(contract.ENSEMBLE))
    assert run(host, host.is_ready)
    assert collect(host, GenerateParams("The cat", 2))[-1].num_output_tokens == 2


def test_a_cancelled_caller_leaves_no_memory_behind_in_triton(host):
    """Serve cancels the replica's generator when a client goes away. That cancellation
    must not reach the gRPC stream: Triton 2.51 keeps ~6 KiB of each cancelled stream
    for good (300 of them grew tritonserver by 1.8-2.0 MiB before the fix, by
    0.02-0.15 MiB after). The sidecar stops the request and reads its stream out."""
    if not hasattr(host, "process"):
        pytest.skip("the in-process host has no gRPC stream")

    async def consume(started: asyncio.Event) -> None:
        async for _ in host.generate(GenerateParams("The cat", 200, min_tokens=200)):
            started.set()

    async def cancelled_callers(n: int) -> None:
        for _ in range(n):
            started = asyncio.Event()
            task = asyncio.create_task(consume(started))
            await started.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    run(host, lambda: cancelled_callers(20))  # warm-up: the first requests' allocations
    before = resident_kib(host.process.pid)
    run(host, lambda: cancelled_callers(300))
    assert resident_kib(host.process.pid) - before < 1024
    wait_for(lambda: engine_metrics(host)["tritonllm_engine_running_sequences"] == 0, 10)


def resident_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))


def test_readiness_follows_the_server(host):
    # Last in this module: it stops the shared server (the fixture's stop is a no-op then).
    assert run(host, host.is_ready)
    host.stop()
    assert not run(host, host.is_ready)
    with pytest.raises(GenerationError) as info:
        collect(host, GenerateParams("The cat", 2))
    assert info.value.retryable
