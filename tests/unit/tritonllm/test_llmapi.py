"""tritonllm.llmapi: our tensor contract over TensorRT-LLM's LLM API, without TensorRT-LLM.

What is under test is our side: the sampling arguments we hand over, the chunks we make
of the LLM API's outputs (stop words, end id, streaming increments, echo), the queue
bound, cancellation and errors. The LLM is a fake that streams a scripted answer the way
the LLM API's ``RequestOutput`` does (cumulative ``token_ids``, ``finished``,
``finish_reason``, ``abort()``); what the real one does with these arguments needs a
GPU (scripts/gpu_smoke.sh).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tritonllm.contract import LORA_CACHE_MISS, lora_cache_miss
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.sampling import SamplingParams as OurSampling
from tritonllm.engine.scheduler import EngineBusy
from tritonllm.llmapi import (
    LLMAPIEngine,
    OutputTracker,
    llm_kwargs,
    lora_adapters,
    sampling_kwargs,
)
from tritonllm.lora import AdapterError
from tritonllm.tokenization import InvalidRequest

EOS = 2


def request(**kw) -> GenerationRequest:
    sampling = kw.pop("sampling", OurSampling())
    values = {"request_id": "r1", "input_ids": (5, 6, 7), "max_tokens": 8, "end_id": EOS}
    return GenerationRequest(**{**values, **kw}, sampling=sampling)


def test_greedy_unless_asked_and_a_temperature_alone_samples():
    greedy = sampling_kwargs(request())
    assert greedy["top_k"] == 1 and "temperature" not in greedy and "top_p" not in greedy
    assert greedy["max_tokens"] == 8 and greedy["end_id"] == EOS
    assert greedy["detokenize"] is False and greedy["add_special_tokens"] is False
    assert sampling_kwargs(request(sampling=OurSampling(temperature=0.0)))["top_k"] == 1
    hot = sampling_kwargs(request(sampling=OurSampling(temperature=0.7, seed=3)))
    assert hot["top_k"] == 0 and hot["temperature"] == 0.7 and hot["seed"] == 3
    nucleus = sampling_kwargs(request(sampling=OurSampling(top_p=0.9, top_k=40)))
    assert (nucleus["top_p"], nucleus["top_k"]) == (0.9, 40)
    assert sampling_kwargs(request(return_log_probs=True))["logprobs"] == 1


def test_bad_words_are_single_tokens_or_refused():
    one = sampling_kwargs(request(sampling=OurSampling(bad_words=((9,), (11,)))))
    assert one["bad_token_ids"] == [9, 11]
    with pytest.raises(InvalidRequest, match="more than one token"):
        sampling_kwargs(request(sampling=OurSampling(bad_words=((9, 10),))))


def test_streaming_sends_the_new_tokens_and_ends_on_a_stop_word_it_keeps():
    tracker = OutputTracker(request(streaming=True, stop_words=((20, 21),)))
    first, abort = tracker.update([10, 11])
    assert first.token_ids == [10, 11] and not first.finished and not abort
    assert tracker.update([10, 11]) == (None, False)  # nothing new
    last, abort = tracker.update([10, 11, 20, 21, 30])
    assert last.token_ids == [20, 21] and last.finished and last.finish_reason == "stop"
    assert abort and last.num_output_tokens == 4 and last.num_input_tokens == 3
    assert tracker.update([10, 11, 20, 21, 30, 31]) == (None, False)  # done


def test_the_end_id_ends_the_answer_and_is_not_part_of_it():
    tracker = OutputTracker(request(exclude_input_in_output=True))
    assert tracker.update([10]) == (None, False)  # not streaming: one answer at the end
    chunk, abort = tracker.update([10, 11, EOS])
    assert chunk.token_ids == [10, 11] and chunk.finish_reason == "stop" and abort


@pytest.mark.parametrize("streaming", [False, True])
def test_the_end_ids_log_probability_is_kept_where_the_llm_api_returns_it(streaming):
    """Where the LLM API's ids hold the end id with its log probability, it is counted and
    logged last (the contract's FINISH_END_ID); an answer whose ids lack it claims none."""
    tracker = OutputTracker(
        request(exclude_input_in_output=True, return_log_probs=True, streaming=streaming)
    )
    tracker.update([10], [-0.5])
    chunk, _ = tracker.update([10, 11, EOS, 12], [-0.5, -1.0, -0.25, -3.0])
    new = [11] if streaming else [10, 11]
    assert chunk.token_ids == new and chunk.ended_by_end_id and chunk.num_output_tokens == 3
    assert chunk.log_probs == ([-1.0, -0.25] if streaming else [-0.5, -1.0, -0.25])
    assert chunk.cum_log_prob == pytest.approx(-1.75)
    without, _ = OutputTracker(request(return_log_probs=True, exclude_input_in_output=True)).update(
        [10, 11], [-0.5, -1.0], "stop", finished=True
    )
    assert not without.ended_by_end_id and without.log_probs == [-0.5, -1.0]
    word = OutputTracker(request(return_log_probs=True, stop_words=((11,),)))
    stopped, _ = word.update([10, 11, EOS], [-0.5, -1.0, -0.25])
    assert not stopped.ended_by_end_id and stopped.log_probs == [-0.5, -1.0]


def test_not_streaming_echoes_the_prompt_unless_excluded_and_maps_finish_reasons():
    echo, _ = OutputTracker(request()).update([10], finish_reason="length", finished=True)
    assert echo.token_ids == [5, 6, 7, 10] and echo.finish_reason == "length"
    timeout, _ = OutputTracker(request()).update([10], finish_reason="timeout", finished=True)
    assert timeout.finish_reason == "length"
    capped, abort = OutputTracker(request(max_tokens=2, exclude_input_in_output=True)).update(
        [10, 11, 12]
    )
    assert capped.token_ids == [10, 11] and capped.finish_reason == "length" and not abort


def test_log_probs_of_the_sampled_tokens():
    @dataclass
    class Logprob:
        logprob: float

    tracker = OutputTracker(request(exclude_input_in_output=True, return_log_probs=True))
    chunk, _ = tracker.update(
        [10, 11], [{10: Logprob(-0.5), 3: Logprob(-0.1)}, -1.5], "length", finished=True
    )
    assert chunk.log_probs == [-0.5, -1.5] and chunk.cum_log_prob == -2.0
    streamed = OutputTracker(request(streaming=True, return_log_probs=True))
    first, _ = streamed.update([10], [-0.5])
    last, _ = streamed.update([10, 11, 12], [-0.5, -1.0, -0.25], "length", finished=True)
    assert first.log_probs == [-0.5] and last.log_probs == [-1.0, -0.25]
    assert last.cum_log_prob == -1.75 and last.num_output_tokens == 3


def test_llm_kwargs_use_tensorrt_llms_own_converter_where_it_exists(monkeypatch, tmp_path):
    options = {"max_batch_size": 4, "kv_cache_config": {"free_gpu_memory_fraction": 0.5}}
    xgrammar = {"guided_decoding_backend": "xgrammar"}
    assert llm_kwargs(tmp_path, options) == {"model": str(tmp_path), **xgrammar, **options}
    converted = {}

    def update(base, extra):
        converted.update(base=base, extra=extra)
        return {**base, "converted": True}

    modules = {
        "tensorrt_llm": types.ModuleType("tensorrt_llm"),
        "tensorrt_llm.llmapi": types.ModuleType("tensorrt_llm.llmapi"),
        "tensorrt_llm.llmapi.llm_utils": types.ModuleType("tensorrt_llm.llmapi.llm_utils"),
    }
    modules["tensorrt_llm.llmapi.llm_utils"].update_llm_args_with_extra_dict = update
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    expected = {"model": str(tmp_path), **xgrammar, "converted": True}
    assert llm_kwargs(tmp_path, options) == expected
    assert converted["extra"] == options


# -- the engine over a fake LLM ----------------------------------------------------------


@dataclass
class Completion:
    token_ids: list
    finish_reason: str | None = None
    logprobs: list | None = None


class FakeOutput:
    """The LLM API's RequestOutput: async-iterable (streaming) or ``aresult()``."""

    def __init__(self, script: list[int], delay_s: float, stall: bool = False):
        self.script, self.delay_s, self.stall = script, delay_s, stall
        self.aborted = False
        self.outputs = [Completion([])]
        self.finished = False

    async def _steps(self):
        if self.stall:  # queued inside the engine: no output until aborted
            while not self.aborted:
                await asyncio.sleep(0.01)
        for token in self.script:
            if self.aborted:
                break
            await asyncio.sleep(self.delay_s)
            self.outputs[0].token_ids = [*self.outputs[0].token_ids, token]
            yield self
        self.finished = True
        self.outputs[0].finish_reason = "cancelled" if self.aborted else "length"
        yield self

    def __aiter__(self):
        return self._steps()

    async def aresult(self):
        async for _ in self._steps():
            pass
        return self

    def abort(self):
        self.aborted = True


class FakeLLM:
    def __init__(self, script=(10, 11, 12, 13), delay_s=0.005, error=None, stall=False):
        self.script, self.delay_s, self.error, self.stall = list(script), delay_s, error, stall
        self.calls, self.outputs, self.shut_down = [], [], False
        self.lora_requests = []

    def generate_async(self, prompt, sampling_params, streaming, lora_request=None):
        if self.error:
            raise self.error
        self.calls.append((prompt, sampling_params, streaming))
        self.lora_requests.append(lora_request)
        output = FakeOutput(self.script, self.delay_s, self.stall)
        self.outputs.append(output)
        return output

    def shutdown(self):
        self.shut_down = True


@dataclass
class FakeSamplingParams:
    kwargs: dict

    def __init__(self, **kwargs):
        if kwargs.get("top_k", 0) < 0:
            raise ValueError("top_k must be >= 0")
        self.kwargs = kwargs


@dataclass
class Sink:
    chunks: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def send(self, chunk):
        self.chunks.append(chunk)
        if chunk.finished:
            self.done.set()

    def fail(self, message, code="INTERNAL"):
        self.errors.append((code, message))
        self.done.set()

    def is_cancelled(self):
        return self.cancelled


@pytest.fixture
def make_engine():
    engines = []

    def make(llm=None, **limits):
        engine = LLMAPIEngine(
            llm or FakeLLM(),
            FakeSamplingParams,
            **{"max_batch_size": 2, "max_queue_size": 1, **limits},
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def wait(sink: Sink) -> Sink:
    assert sink.done.wait(5), "no final response"
    return sink


def test_a_streamed_request_arrives_token_by_token_then_finishes(make_engine):
    llm = FakeLLM()
    engine = make_engine(llm)
    sink = Sink()
    engine.submit(request(streaming=True, max_tokens=8), sink)
    wait(sink)
    assert [c.token_ids for c in sink.chunks[:-1]] == [[10], [11], [12], [13]]
    assert sink.chunks[-1].finished and sink.chunks[-1].finish_reason == "length"
    prompt, params, streaming = llm.calls[0]
    assert prompt == {"prompt_token_ids": [5, 6, 7]} and streaming
    assert params.kwargs["top_k"] == 1 and params.kwargs["max_tokens"] == 8
    for _ in range(100):  # the slot is given back once the request has ended
        if engine.active() == 0:
            break
        time.sleep(0.01)
    assert engine.active() == 0


def test_a_stop_word_aborts_the_request_in_the_engine(make_engine):
    llm = FakeLLM(script=(10, 11, 12, 13))
    engine = make_engine(llm)
    sink = wait_submit(engine, request(stop_words=((11, 12),), exclude_input_in_output=True))
    assert sink.chunks[-1].token_ids == [10, 11, 12] and sink.chunks[-1].finish_reason == "stop"
    assert len(sink.chunks) == 1  # not streamed to the client: one answer
    assert llm.calls[0][2] is True  # but streamed from the engine, to stop it at once
    assert llm.outputs[0].aborted


def wait_submit(engine, req) -> Sink:
    sink = Sink()
    engine.submit(req, sink)
    return wait(sink)


def test_a_gone_client_and_a_stop_request_abort_even_a_queued_request(make_engine):
    llm = FakeLLM(stall=True)
    engine = make_engine(llm)
    gone = Sink()
    engine.submit(request(request_id="a", streaming=True), gone)
    stopped = Sink()
    engine.submit(request(request_id="b", streaming=True), stopped)
    time.sleep(0.05)
    gone.cancelled = True  # what the response thread sets when Triton says so
    engine.cancel("b")  # the contract's `stop` input for request id b
    for sink in (wait(gone), wait(stopped)):
        assert sink.chunks[-1].finish_reason == "cancelled"
    assert all(output.aborted for output in llm.outputs)


def test_past_the_queue_bound_a_request_is_refused_busy(make_engine):
    engine = make_engine(FakeLLM(stall=True), max_batch_size=1, max_queue_size=1)
    for name in ("a", "b"):
        engine.submit(request(request_id=name), Sink())
    with pytest.raises(EngineBusy, match="max_batch_size \\+ max_queue_size"):
        engine.submit(request(request_id="c"), Sink())
    engine.cancel("a")
    for _ in range(200):
        if engine.active() < 2:
            break
        time.sleep(0.01)
    engine.submit(request(request_id="d"), Sink())  # room again


def test_limits_and_bad_parameters_are_invalid_requests(make_engine):
    engine = make_engine(max_input_len=2, max_seq_len=10)
    with pytest.raises(InvalidRequest, match="max_input_len"):
        engine.submit(request(), Sink())
    with pytest.raises(InvalidRequest, match="max_seq_len"):
        engine.submit(request(input_ids=(5,), max_tokens=10), Sink())
    engine = make_engine()
    with pytest.raises(InvalidRequest, match="invalid sampling parameters"):
        engine.submit(_negative_top_k(), Sink())
    assert engine.active() == 0


def _negative_top_k() -> GenerationRequest:
    req = request(sampling=OurSampling(temperature=1.0))
    object.__setattr__(req.sampling, "top_k", -1)  # past our own check: TensorRT-LLM's refuses
    return req


def test_an_engine_error_is_an_error_response_with_its_kind(make_engine):
    sink = wait_submit(make_engine(FakeLLM(error=ValueError("prompt too long"))), request())
    assert sink.errors == [("INVALID_ARG", "TensorRT-LLM: prompt too long")]
    sink = wait_submit(make_engine(FakeLLM(error=RuntimeError("CUDA error"))), request())
    assert sink.errors[0][0] == "INTERNAL"


def test_shutdown_stops_the_llm(make_engine):
    llm = FakeLLM()
    engine = LLMAPIEngine(llm, FakeSamplingParams, max_batch_size=1, max_queue_size=0)
    engine.shutdown()
    assert llm.shut_down


@dataclass
class FakeGuidedDecodingParams:
    kwargs: dict

    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.mark.parametrize(
    ("guide_type", "guide", "expected"),
    [
        ("json", "", {"json_object": True}),
        ("json_schema", '{"type": "integer"}', {"json": '{"type": "integer"}'}),
        ("regex", "[a-z]+", {"regex": "[a-z]+"}),
        ("ebnf_grammar", 'root ::= "a"', {"grammar": 'root ::= "a"'}),
    ],
)
def test_guides_pass_through_as_guided_decoding_params(guide_type, guide, expected):
    engine = LLMAPIEngine(
        FakeLLM(),
        FakeSamplingParams,
        max_batch_size=1,
        max_queue_size=0,
        guided_decoding_params_cls=FakeGuidedDecodingParams,
    )
    try:
        params = engine._sampling_params(request(guide_type=guide_type, guide=guide))
        assert params.kwargs["guided_decoding"].kwargs == expected
        assert "guided_decoding" not in engine._sampling_params(request()).kwargs
        with pytest.raises(InvalidRequest, match="not a valid JSON Schema"):
            engine._sampling_params(request(guide_type="json_schema", guide='{"type": 1}'))
    finally:
        engine.shutdown()
    plain = LLMAPIEngine(FakeLLM(), FakeSamplingParams, max_batch_size=1, max_queue_size=0)
    try:
        with pytest.raises(InvalidRequest, match="guided decoding is not available"):
            plain._sampling_params(request(guide_type=guide_type, guide=guide))
    finally:
        plain.shutdown()


# -- LoRA: the contract's tensors as the LLM API's LoRARequest ------------------------------


@dataclass
class FakeLoRARequest:
    """tensorrt_llm.executor.request.LoRARequest(lora_name, lora_int_id, lora_path)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def packed_adapter(checkpoint_dir, rank: int = 4, seed: int = 0):
    """A PEFT-named q/v adapter of the default model, packed as the Serve side sends it."""
    import json

    import numpy as np

    from tritonllm.lora import llama_module_shapes, pack_peft

    shapes, _ = llama_module_shapes(json.loads((checkpoint_dir / "config.json").read_text()))
    rng = np.random.default_rng(seed)
    state = {}
    for module in ("q_proj", "v_proj"):
        fan_in, fan_out = shapes[module]
        prefix = f"base_model.model.model.layers.1.self_attn.{module}"
        state[f"{prefix}.lora_A.weight"] = rng.normal(size=(rank, fan_in))
        state[f"{prefix}.lora_B.weight"] = rng.normal(size=(fan_out, rank))
    return pack_peft({"r": rank, "lora_alpha": 2 * rank}, state)


@pytest.fixture
def lora_engine(checkpoint_dir, tmp_path):
    from build_engines.trtllm_settings import TrtllmSettings, llm_api_options

    options = llm_api_options(TrtllmSettings())  # the shipped lora: section
    adapters = lora_adapters(checkpoint_dir, options, tmp_path / "adapters")
    llm = FakeLLM(script=(10, 11))
    engine = LLMAPIEngine(
        llm,
        FakeSamplingParams,
        max_batch_size=4,
        max_queue_size=4,
        adapters=adapters,
        lora_request_cls=FakeLoRARequest,
    )
    yield engine, llm
    engine.shutdown()


def test_an_adapter_is_written_once_and_named_by_its_task_id_after(lora_engine, checkpoint_dir):
    from peft import LoraConfig as PeftLoraConfig

    from tritonllm.lora import read_peft_dir

    engine, llm = lora_engine
    packed = packed_adapter(checkpoint_dir)
    first = wait_submit(engine, request(lora_task_id=7, lora=packed))
    again = wait_submit(engine, request(lora_task_id=7))  # the id alone, as Serve sends it
    base = wait_submit(engine, request())
    assert [s.errors for s in (first, again, base)] == [[], [], []]
    with_adapter, by_id, without = llm.lora_requests
    assert with_adapter == by_id and without is None
    assert (with_adapter.lora_name, with_adapter.lora_int_id) == ("task-7", 7)
    path = Path(with_adapter.lora_path)
    config = PeftLoraConfig.from_pretrained(path)  # a PEFT directory PEFT reads
    assert (config.r, config.lora_alpha) == (4, 4)
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    written = read_peft_dir(lambda name: (path / name).read_bytes())
    assert (written.config == packed.config).all()
    assert (written.weights == packed.weights).all()  # float16 in, float16 out: exact


def test_an_id_not_held_is_tensorrt_llms_cache_miss_and_nothing_runs(lora_engine):
    engine, llm = lora_engine
    with pytest.raises(InvalidRequest) as miss:
        engine.submit(request(lora_task_id=42), Sink())
    assert str(miss.value) == lora_cache_miss(42)
    assert LORA_CACHE_MISS.match(str(miss.value))[1] == "42"
    assert llm.calls == [] and engine.active() == 0


def test_adapters_that_do_not_fit_and_weights_without_an_id_are_refused(
    lora_engine, checkpoint_dir, make_engine
):
    import numpy as np

    from tritonllm.lora import LoraTensors

    engine, llm = lora_engine
    with pytest.raises(InvalidRequest, match="rank 128.*up to 64"):
        engine.submit(request(lora_task_id=1, lora=packed_adapter(checkpoint_dir, 128)), Sink())
    other_base = LoraTensors(
        np.zeros((1, 4 * 8), dtype=np.float16), np.array([[1, 0, 4]], dtype=np.int32)
    )
    with pytest.raises(InvalidRequest, match="another base"):
        engine.submit(request(lora_task_id=2, lora=other_base), Sink())
    with pytest.raises(InvalidRequest, match="without lora_task_id"):
        engine.submit(request(lora=packed_adapter(checkpoint_dir)), Sink())
    with pytest.raises(InvalidRequest, match="serves no LoRA adapters.*lora: section"):
        make_engine().submit(request(lora_task_id=1, lora=packed_adapter(checkpoint_dir)), Sink())
    assert llm.calls == []


def test_lora_adapters_follow_the_llm_api_options(checkpoint_dir, tmp_path):
    from build_engines.trtllm_settings import TrtllmSettings, llm_api_options

    assert (
        lora_adapters(checkpoint_dir, llm_api_options(TrtllmSettings(lora=None)), tmp_path) is None
    )
    settings = TrtllmSettings.from_dict(
        {"lora": {"max_rank": 8, "max_cpu_loras": 2, "max_loras": 1}}
    )
    adapters = lora_adapters(checkpoint_dir, llm_api_options(settings), tmp_path / "a")
    for task_id in range(6):  # twice max_cpu_loras kept on disk
        adapters.path(task_id, packed_adapter(checkpoint_dir, rank=8, seed=task_id))
    assert len(adapters) == 4 and 0 not in adapters and 5 in adapters
    with pytest.raises(AdapterError, match="up to 8"):
        adapters.path(9, packed_adapter(checkpoint_dir, rank=16))
