"""The null engine (a benchmark instrument) under the real scheduler: the default
model's tokenizer, no model math, and the limits a real engine honours."""

from __future__ import annotations

import time

import pytest

from tests.unit.tritonllm.engine.test_engine import CollectingSink
from tritonllm.engine.null_engine import NullRunner
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.sampling import SamplingParams
from tritonllm.engine.scheduler import Engine

STEP_S = 0.01


@pytest.fixture(scope="module")
def runner(checkpoint_dir):
    return NullRunner(checkpoint_dir, step_s=STEP_S)


@pytest.fixture
def engine(runner):
    engine = Engine(runner, max_batch_size=4, max_queue_size=8)
    yield engine
    engine.shutdown()


def generate(engine, sink=None, prompt=(5, 6, 7), max_tokens=8, rid="r", **kwargs):
    sink = sink or CollectingSink()
    kwargs.setdefault("end_id", 0)
    request = GenerationRequest(rid, tuple(prompt), max_tokens, streaming=True, **kwargs)
    engine.submit(request, sink)
    return sink


def test_it_streams_the_script_in_real_token_ids_of_the_tokenizer(engine, runner, tokenizer):
    first, again, other = (generate(engine, prompt=p) for p in ((5, 6, 7), (5, 6, 7), (9, 9)))
    for sink in (first, again, other):
        assert sink.done.wait(10)
        assert len(sink.tokens()) == 8 and sink.chunks[-1].finish_reason == "length"
    assert first.tokens() == again.tokens()  # equal prompts, equal answers
    assert first.tokens() != other.tokens()
    assert set(first.tokens()) <= set(runner.script)
    text = tokenizer.decode(runner.script)
    assert "crème brûlée" in text and "\ufffd" not in text


def test_a_step_takes_the_step_time_and_the_batch_shares_it(engine):
    start = time.perf_counter()
    sinks = [generate(engine, prompt=(i + 3,), max_tokens=10, rid=str(i)) for i in range(4)]
    assert all(sink.done.wait(10) for sink in sinks)
    elapsed = time.perf_counter() - start
    # One prefill and nine decodes, shared by the four sequences (not four times over).
    assert 10 * STEP_S <= elapsed < 4 * 10 * STEP_S


def test_stop_words_min_tokens_and_the_end_id_are_honoured(checkpoint_dir, engine):
    plain = generate(engine, max_tokens=12)
    assert plain.done.wait(10)
    tokens = plain.tokens()
    stop = generate(engine, max_tokens=12, stop_words=((tokens[3], tokens[4]),))
    assert stop.done.wait(10)
    assert stop.tokens() == tokens[:5] and stop.chunks[-1].finish_reason == "stop"

    ending = Engine(NullRunner(checkpoint_dir, step_s=0.001, answer_tokens=3), max_batch_size=2)
    try:
        short = generate(ending, max_tokens=12)
        longer = generate(ending, max_tokens=12, rid="m", sampling=SamplingParams(min_tokens=6))
        assert short.done.wait(10) and longer.done.wait(10)
        # The end token is counted (as vLLM counts it), not returned (as TensorRT-LLM).
        assert short.tokens() == tokens[:3] and short.chunks[-1].finish_reason == "stop"
        assert short.chunks[-1].num_output_tokens == 4
        assert longer.tokens() == tokens[:6]
    finally:
        ending.shutdown()


def test_a_cancelled_request_ends_within_a_step(engine):
    sink = generate(engine, max_tokens=400, rid="long")
    time.sleep(5 * STEP_S)
    engine.cancel("long")
    assert sink.done.wait(1)
    assert sink.chunks[-1].finish_reason == "cancelled" and len(sink.tokens()) < 50
