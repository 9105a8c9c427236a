"""The torch engine without Triton: the real model, a fake response sink."""

from __future__ import annotations

import threading
import time

import pytest

from tests.reference import hf_greedy
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.sampling import SamplingParams
from tritonllm.engine.scheduler import Engine, EngineBusy
from tritonllm.tokenization import InvalidRequest

# On any device (CUDA's default is bfloat16): the references are transformers' float32.
DTYPE = "float32"


class CollectingSink:
    def __init__(self, cancelled: bool = False):
        self.chunks = []
        self.times = []  # perf_counter() of each chunk
        self.errors = []
        self.codes = []  # each error's Triton code
        self.failed_at = None  # perf_counter() of the error
        self.done = threading.Event()
        self.cancelled = cancelled

    def send(self, chunk):
        self.chunks.append(chunk)
        self.times.append(time.perf_counter())
        if chunk.finished:
            self.done.set()

    def fail(self, message, code="INTERNAL"):
        self.errors.append(message)
        self.codes.append(code)
        self.failed_at = time.perf_counter()
        self.done.set()

    def is_cancelled(self):
        return self.cancelled

    def tokens(self):
        return [t for c in self.chunks for t in c.token_ids]


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    engine = Engine(CausalLMRunner(checkpoint_dir, dtype=DTYPE), max_batch_size=4, max_queue_size=8)
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
    engine = Engine(CausalLMRunner(checkpoint_dir, dtype=DTYPE), max_batch_size=1, max_queue_size=1)
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


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


class RecordingObserver:
    def __init__(self):
        self.steps = []

    def on_step(self, stats):
        self.steps.append(stats)


@pytest.fixture
def make_engine(checkpoint_dir):
    engines = []

    def make(**kwargs):
        engines.append(Engine(CausalLMRunner(checkpoint_dir, dtype=DTYPE), **kwargs))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


SIXTEEN_PROMPTS = [
    "The cat",
    "Where is the river? The old man",
    "A robot builds many requests near the sea and then",
    "日本語は",
    "In the morning the teacher",
    "Hello",
    "The scheduler sends a long letter to the robot, and the robot",
    "Crème brûlée",
    "Why",
    "The dog and the cat sat near the window while",
    "Привет",
    "Once upon a time",
    "Many towns",
    "The server answers every request",
    "A",
    "Where is the old man? The teacher said that",
]


def test_sixteen_staggered_greedy_requests_each_equal_generate_alone(
    make_engine, tokenizer, hf_model
):
    observer = RecordingObserver()
    engine = make_engine(max_batch_size=8, max_queue_size=32, observer=observer)
    sinks = []
    for i, prompt in enumerate(SIXTEEN_PROMPTS):
        sink = CollectingSink()
        max_tokens = 6 + (i * 7) % 29
        req = request(
            tokenizer,
            prompt,
            max_tokens,
            rid=str(i),
            streaming=i % 3 != 0,
            exclude_input_in_output=True,
        )
        engine.submit(req, sink)
        sinks.append((sink, prompt, max_tokens))
        time.sleep(0.003 * (i % 4))  # arrivals land between decode steps
    for sink, prompt, max_tokens in sinks:
        assert sink.done.wait(60)
        assert sink.tokens() == hf_greedy(hf_model, tokenizer, prompt, max_tokens, end_id=0)
    assert 1 < max(s.running for s in observer.steps) <= 8  # batched, never past the cap


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(make_engine, tokenizer):
    engine = make_engine(max_batch_size=8)
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.9, seed=1234)

    def seeded(rid):
        return request(
            tokenizer, "The robot", 24, rid=rid, sampling=params, exclude_input_in_output=True
        )

    alone = CollectingSink()
    engine.submit(seeded("alone"), alone)
    assert alone.done.wait(30)
    neighbours = []
    for i in range(6):  # greedy and differently seeded neighbours, started first
        sink = CollectingSink()
        other = SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams()
        engine.submit(request(tokenizer, SIXTEEN_PROMPTS[i], 40, rid=f"n{i}", sampling=other), sink)
        neighbours.append(sink)
    wait_until(lambda: engine.num_running >= 4)
    busy = CollectingSink()
    engine.submit(seeded("busy"), busy)
    assert busy.done.wait(30)
    assert busy.tokens() == alone.tokens()
    assert all(n.done.wait(30) for n in neighbours)


def test_a_new_request_streams_before_a_long_one_finishes(make_engine, tokenizer):
    engine = make_engine(max_batch_size=4)
    long = CollectingSink()
    engine.submit(request(tokenizer, "The cat", 300, rid="long", streaming=True, end_id=None), long)
    wait_until(lambda: len(long.chunks) >= 5)
    short = CollectingSink()
    engine.submit(request(tokenizer, "Hello", 3, rid="short", streaming=True), short)
    assert short.done.wait(30)
    assert not long.done.is_set()  # in-flight: the short one joined the running batch
    assert long.done.wait(60)
    assert short.times[0] < long.times[-1]
    assert len(long.tokens()) == 300


@pytest.mark.parametrize("how", ["stop", "disconnect"])
def test_cancel_and_disconnect_free_the_slot_within_a_step(make_engine, tokenizer, how):
    engine = make_engine(max_batch_size=1)
    long = CollectingSink()
    engine.submit(request(tokenizer, "The cat", 400, rid="long", streaming=True, end_id=None), long)
    waiting = CollectingSink()
    engine.submit(request(tokenizer, "Hello", 4, rid="next", streaming=True), waiting)
    wait_until(lambda: len(long.chunks) >= 3)
    assert not waiting.chunks  # one slot: it waits
    if how == "stop":
        engine.cancel("long")
    else:
        long.cancelled = True  # what Triton's request.is_cancelled() reports
    assert waiting.done.wait(30)
    assert long.chunks[-1].finish_reason == "cancelled"
    # The long request ended within a step or two of the cancel, not after 400 tokens.
    assert len(long.tokens()) < 20
    assert long.times[-1] < waiting.times[0]


def test_cancelling_a_queued_request_answers_it_without_running_it(make_engine, tokenizer):
    engine = make_engine(max_batch_size=1)
    long = CollectingSink()
    engine.submit(request(tokenizer, "The cat", 400, rid="long", streaming=True, end_id=None), long)
    queued = CollectingSink()
    engine.submit(request(tokenizer, "Hello", 4, rid="queued"), queued)
    wait_until(lambda: len(long.chunks) >= 2)
    engine.cancel("queued")
    assert queued.done.wait(5)
    assert queued.chunks[-1].finish_reason == "cancelled"
    assert queued.chunks[-1].num_output_tokens == 0
    assert not long.done.is_set()
    engine.cancel("long")
    assert long.done.wait(30)


def test_a_full_engine_admits_by_priority_then_first_come_first_served(make_engine, tokenizer):
    """vLLM's order: lower priority first; the default 0 between; equals in turn."""
    engine = make_engine(max_batch_size=1)
    long = CollectingSink()
    engine.submit(request(tokenizer, "The cat", 400, rid="long", streaming=True, end_id=None), long)
    wait_until(lambda: len(long.chunks) >= 2)  # the one slot is taken: the rest queue
    queued = [("late", 5), ("first-0", 0), ("urgent", -3), ("second-0", 0), ("later", 5)]
    sinks = {}
    for rid, priority in queued:
        sinks[rid] = CollectingSink()
        engine.submit(request(tokenizer, "Hello", 2, rid=rid, priority=priority), sinks[rid])
    engine.cancel("long")
    for sink in sinks.values():
        assert sink.done.wait(60)
    started = sorted(sinks, key=lambda rid: sinks[rid].times[0])
    assert started == ["urgent", "first-0", "second-0", "late", "later"]


def test_a_prompt_over_the_token_budget_is_rejected_and_the_engine_serves_on(
    make_engine, tokenizer
):
    engine = make_engine(max_batch_size=2, max_num_tokens=8)
    with pytest.raises(InvalidRequest, match="exceeds the engine's max_num_tokens"):
        engine.submit(request(tokenizer, "The dog and the cat sat near the window", 4), None)
    sink = CollectingSink()
    engine.submit(request(tokenizer, "Hi", 4), sink)
    assert sink.done.wait(30)
    assert sink.chunks[-1].finish_reason == "length"


def test_the_token_budget_spreads_prefills_over_steps(make_engine, tokenizer):
    observer = RecordingObserver()
    engine = make_engine(max_batch_size=8, max_num_tokens=12, observer=observer)
    sinks = [CollectingSink() for _ in range(4)]
    for i, sink in enumerate(sinks):
        engine.submit(request(tokenizer, "The cat sat", 3, rid=str(i)), sink)  # 4 tokens each
    assert all(s.done.wait(30) for s in sinks)
    assert max(s.prefill_tokens for s in observer.steps) <= 12


LONG_PROMPT = " ".join(SIXTEEN_PROMPTS)  # ~100 tokens of the tiny model


def test_chunked_context_prefills_a_long_prompt_over_steps_with_the_same_output(
    make_engine, tokenizer, hf_model
):
    observer = RecordingObserver()
    engine = make_engine(
        max_batch_size=4, max_num_tokens=16, enable_chunked_context=True, observer=observer
    )
    prompt_tokens = len(tokenizer.encode(LONG_PROMPT))
    assert prompt_tokens > 5 * 16
    sinks = [CollectingSink(), CollectingSink()]
    engine.submit(
        request(tokenizer, LONG_PROMPT, 20, rid="whole", exclude_input_in_output=True), sinks[0]
    )
    engine.submit(request(tokenizer, LONG_PROMPT, 20, rid="streamed", streaming=True), sinks[1])
    expected = hf_greedy(hf_model, tokenizer, LONG_PROMPT, 20, end_id=0)
    for sink in sinks:
        assert sink.done.wait(60) and not sink.errors
        assert sink.tokens() == expected
    assert max(s.prefill_tokens for s in observer.steps) <= 16  # never more than a chunk
    assert sum(s.prefill_tokens for s in observer.steps) == 2 * prompt_tokens


def test_chunked_context_serves_a_short_prompt_before_a_long_one_finishes_its_prefill(
    make_engine, tokenizer, hf_model
):
    engine = make_engine(max_batch_size=4, max_num_tokens=16, enable_chunked_context=True)
    long, short = CollectingSink(), CollectingSink()
    engine.submit(request(tokenizer, LONG_PROMPT, 4, rid="long", streaming=True), long)
    wait_until(lambda: engine.num_running == 1)  # its first chunks are under way
    engine.submit(request(tokenizer, "Hello", 6, rid="short", streaming=True), short)
    assert short.done.wait(30) and long.done.wait(30)
    # Shortest remaining prompt first: "Hello" took the step's budget before the long
    # prompt's next chunk, and streamed while the long one still had chunks to go.
    assert short.times[0] < long.times[0]
    assert short.tokens() == hf_greedy(hf_model, tokenizer, "Hello", 6, end_id=0)
    assert long.tokens() == hf_greedy(hf_model, tokenizer, LONG_PROMPT, 4, end_id=0)


def test_chunked_context_takes_prompts_over_the_token_budget(make_engine, tokenizer):
    engine = make_engine(max_batch_size=2, max_num_tokens=8, enable_chunked_context=True)
    sink = CollectingSink()
    engine.submit(request(tokenizer, "The dog and the cat sat near the window", 4), sink)
    assert sink.done.wait(30) and sink.chunks[-1].finish_reason == "length"


class BrokenSink(CollectingSink):
    def send(self, chunk):
        raise RuntimeError("the response sender is closed")


def test_a_sink_that_fails_ends_only_its_own_request(make_engine, tokenizer, hf_model):
    engine = make_engine(max_batch_size=4)
    broken, good = BrokenSink(), CollectingSink()
    engine.submit(request(tokenizer, "The cat", 30, rid="broken", streaming=True), broken)
    engine.submit(request(tokenizer, "Hello", 12, rid="good", exclude_input_in_output=True), good)
    assert good.done.wait(30)
    assert good.tokens() == hf_greedy(hf_model, tokenizer, "Hello", 12, end_id=0)
    wait_until(lambda: engine.num_running == 0)


def test_prefill_groups_batch_similar_lengths_and_keep_padding_under_half():
    from tritonllm.engine.scheduler import Sequence, _prefill_groups

    def seq(n):
        return Sequence(GenerationRequest(str(n), (1,) * n, 4), None, None, history=[1] * n)

    groups = _prefill_groups([(seq(n), n) for n in (30, 4, 32, 5, 31, 300)])
    lengths = [[size for s, size in g] for g in groups]
    assert all(len(s.history) == size for g in groups for s, size in g)
    assert sorted(n for g in lengths for n in g) == [4, 5, 30, 31, 32, 300]
    for group in lengths:
        assert len(group) * max(group) <= 2 * sum(group)
    assert [300] in lengths and [30, 31, 32] in lengths


def test_a_reused_request_id_is_cancellable_while_any_holder_runs(make_engine, tokenizer):
    engine = make_engine(max_batch_size=2)
    first, second = CollectingSink(), CollectingSink()
    engine.submit(request(tokenizer, "Hi", 2, rid="same"), first)
    engine.submit(request(tokenizer, "The cat", 400, rid="same", end_id=None), second)
    assert first.done.wait(30)
    engine.cancel("same")  # the first holder finished; the second still runs
    assert second.done.wait(30)
    assert second.chunks[-1].finish_reason == "cancelled"


def test_an_empty_request_id_cancels_nothing(make_engine, tokenizer):
    engine = make_engine(max_batch_size=2)
    sink = CollectingSink()
    engine.submit(request(tokenizer, "Hi", 20, rid=""), sink)
    engine.cancel("")
    assert sink.done.wait(30)
    assert sink.chunks[-1].finish_reason == "length"
