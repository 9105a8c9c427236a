"""The torch engine without Triton: the real model, a fake response sink."""

from __future__ import annotations

import threading

import pytest

from tests.reference import hf_greedy
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.sampling import SamplingParams
from tritonllm.engine.scheduler import Engine, EngineBusy
from tritonllm.tokenization import InvalidRequest


class CollectingSink:
    def __init__(self, cancelled: bool = False):
        self.chunks = []
        self.errors = []
        self.done = threading.Event()
        self.cancelled = cancelled

    def send(self, chunk):
        self.chunks.append(chunk)
        if chunk.finished:
            self.done.set()

    def fail(self, message):
        self.errors.append(message)
        self.done.set()

    def is_cancelled(self):
        return self.cancelled

    def tokens(self):
        return [t for c in self.chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    engine = Engine(CausalLMRunner(checkpoint_dir), max_batch_size=4, max_queue_size=8)
    yield engine
    engine.shutdown()


def request(tokenizer, prompt, max_tokens, rid="r", **kwargs):
    return GenerationRequest(
        request_id=rid,
        input_ids=tuple(tokenizer.encode(prompt)),
        max_tokens=max_tokens,
        end_id=kwargs.pop("end_id", 0),
        **kwargs,
    )


def test_interleaved_requests_each_equal_generate(engine, tokenizer, hf_model):
    prompts = ["The cat", "Where is the river?", "日本語は", "A robot builds many requests"]
    sinks = []
    for i, prompt in enumerate(prompts):
        sink = CollectingSink()
        engine.submit(
            request(
                tokenizer,
                prompt,
                10 + 3 * i,
                rid=str(i),
                streaming=i % 2 == 0,
                exclude_input_in_output=True,
            ),
            sink,
        )
        sinks.append(sink)
    for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
        assert sink.done.wait(60)
        assert sink.tokens() == hf_greedy(hf_model, tokenizer, prompt, 10 + 3 * i, end_id=0)
        assert sink.chunks[-1].finish_reason == "length"


def test_streaming_sends_one_token_per_chunk(engine, tokenizer):
    sink = CollectingSink()
    engine.submit(request(tokenizer, "The cat", 6, streaming=True), sink)
    assert sink.done.wait(30)
    assert [len(c.token_ids) for c in sink.chunks] == [1] * 6
    assert [c.finished for c in sink.chunks] == [False] * 5 + [True]


def test_non_streamed_output_starts_with_the_prompt(engine, tokenizer):
    sink = CollectingSink()
    req = request(tokenizer, "The cat", 5)
    engine.submit(req, sink)
    assert sink.done.wait(30)
    assert sink.tokens()[: len(req.input_ids)] == list(req.input_ids)
    assert len(sink.tokens()) == len(req.input_ids) + 5


def test_cancelled_request_ends_with_what_it_has(engine, tokenizer):
    sink = CollectingSink(cancelled=True)
    engine.submit(request(tokenizer, "The cat", 50, exclude_input_in_output=True), sink)
    assert sink.done.wait(30)
    assert sink.chunks[-1].finish_reason == "cancelled"
    assert sink.tokens() == []


def test_stop_by_request_id(engine, tokenizer):
    sink = CollectingSink()
    engine.submit(request(tokenizer, "The cat", 400, rid="long", streaming=True), sink)
    while len(sink.chunks) < 3:
        sink.done.wait(0.01)
    engine.cancel("long")
    assert sink.done.wait(30)
    assert sink.chunks[-1].finish_reason == "cancelled"
    assert len(sink.tokens()) < 400


def test_cancelling_an_unknown_id_is_ignored(engine, tokenizer):
    engine.cancel("never-submitted")
    assert "never-submitted" not in engine._cancelled
    sink = CollectingSink()
    engine.submit(request(tokenizer, "The cat", 3, rid="never-submitted"), sink)
    assert sink.done.wait(30)
    assert sink.chunks[-1].finish_reason == "length"


def test_seeded_sampling_reproduces(engine, tokenizer):
    outs = []
    for _ in range(2):
        sink = CollectingSink()
        params = SamplingParams(temperature=1.5, top_p=0.95, seed=7)
        engine.submit(
            request(tokenizer, "The cat", 20, sampling=params, exclude_input_in_output=True), sink
        )
        assert sink.done.wait(30)
        outs.append(sink.tokens())
    assert outs[0] == outs[1]


def test_limits_are_checked_before_any_work(engine, tokenizer):
    with pytest.raises(InvalidRequest, match="exceeds the maximum sequence length"):
        engine.submit(request(tokenizer, "The cat", engine.max_seq_len), CollectingSink())
    with pytest.raises(InvalidRequest, match="max_tokens must be > 0"):
        engine.submit(request(tokenizer, "The cat", 0), CollectingSink())
    with pytest.raises(InvalidRequest, match="outside"):
        engine.submit(GenerationRequest("x", (10**6,), 4), CollectingSink())


def test_full_queue_answers_busy(checkpoint_dir, tokenizer):
    engine = Engine(CausalLMRunner(checkpoint_dir), max_batch_size=1, max_queue_size=1)
    try:
        sinks = [CollectingSink() for _ in range(3)]
        engine.submit(request(tokenizer, "The cat", 200, rid="a"), sinks[0])
        while not engine._running:  # the first one is running, the queue is empty
            sinks[0].done.wait(0.01)
        engine.submit(request(tokenizer, "The cat", 5, rid="b"), sinks[1])
        with pytest.raises(EngineBusy):
            engine.submit(request(tokenizer, "The cat", 5, rid="c"), sinks[2])
        engine.cancel("a")
        assert sinks[1].done.wait(30)
    finally:
        engine.shutdown()
