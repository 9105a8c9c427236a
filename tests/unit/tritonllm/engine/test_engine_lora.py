"""LoRA adapters in the torch engine, on the real default model: each adapter's greedy
output equals PEFT's own, alone and in batches that mix adapters and the base."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.lora_adapters import SPECS, make_adapter, make_adapters, other_base
from tests.reference import hf_greedy
from tests.unit.tritonllm.engine.test_engine import DTYPE, CollectingSink, request
from tritonllm import contract
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.scheduler import Engine, EngineBusy
from tritonllm.engine.tensors import to_generation_request
from tritonllm.lora import unpack
from tritonllm.tokenization import InvalidRequest

PROMPTS = ["The cat", "Where is the river?", "A robot builds many requests"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(checkpoint_dir, tmp_path_factory):
    return make_adapters(checkpoint_dir, tmp_path_factory.mktemp("adapters"))


class Expected(dict):
    """PEFT's greedy ids by (task id, prompt), the base model's under task id None;
    each computed when first asked for."""

    def __init__(self, models, tokenizer):
        super().__init__()
        self.models, self.tokenizer = models, tokenizer

    def __missing__(self, key):
        task_id, prompt = key
        ids = hf_greedy(self.models[task_id], self.tokenizer, prompt, MAX_TOKENS, end_id=0)
        self[key] = ids
        return ids


@pytest.fixture(scope="module")
def expected(adapters, tokenizer, hf_model):
    return Expected({None: hf_model} | {a.task_id: a.model for a in adapters}, tokenizer)


@pytest.fixture(scope="module")
def runner(checkpoint_dir):
    return CausalLMRunner(checkpoint_dir, dtype=DTYPE)


def new_engine(runner, **kwargs) -> Engine:
    # One runner (its wrapped layers) for every engine of the module: a fresh cache each.
    return Engine(runner, max_batch_size=kwargs.pop("max_batch_size", 8), **kwargs)


@pytest.fixture
def engine(runner):
    engine = new_engine(runner)
    yield engine
    engine.shutdown()


def lora_request(tokenizer, prompt, adapter=None, with_weights=True, rid="r", **kwargs):
    lora = {}
    if adapter is not None:
        lora["lora_task_id"] = adapter.task_id
        lora["lora"] = adapter.tensors if with_weights else None
    return request(
        tokenizer, prompt, kwargs.pop("max_tokens", MAX_TOKENS), rid=rid,
        exclude_input_in_output=True, **lora, **kwargs,
    )  # fmt: skip


def run(engine, requests) -> list[CollectingSink]:
    """Submit all (so that they share forwards), then wait for every answer."""
    sinks = []
    for req in requests:
        sink = CollectingSink()
        engine.submit(req, sink)
        sinks.append(sink)
    for sink in sinks:
        assert sink.done.wait(60)
        assert not sink.errors
    return sinks


def test_the_adapters_change_the_output(adapters, expected):
    """The premise of every test here: each adapter's greedy output is not the base's."""
    for adapter in adapters:
        for prompt in PROMPTS[:2]:
            assert expected[adapter.task_id, prompt] != expected[None, prompt], adapter.spec
    assert sorted({a.spec.rank for a in adapters}) == sorted(s.rank for s in SPECS)


def test_each_adapter_alone_equals_peft(engine, tokenizer, adapters, expected):
    for adapter in adapters:
        for prompt in PROMPTS[:2]:
            (sink,) = run(engine, [lora_request(tokenizer, prompt, adapter)])
            assert sink.tokens() == expected[adapter.task_id, prompt], (adapter.spec, prompt)


def test_a_mixed_batch_equals_peft_and_the_base(
    engine, runner, tokenizer, adapters, expected, monkeypatch
):
    forwards = record_decode_adapters(runner, monkeypatch)
    jobs = [(a, PROMPTS[0]) for a in adapters] + [(None, PROMPTS[0]), (None, PROMPTS[1])]
    jobs.append((adapters[1], PROMPTS[2]))  # an adapter on two rows
    assert len(jobs) == engine.max_batch_size
    sinks = run(
        engine, [lora_request(tokenizer, p, a, rid=str(i)) for i, (a, p) in enumerate(jobs)]
    )
    for (adapter, prompt), sink in zip(jobs, sinks, strict=True):
        task_id = adapter.task_id if adapter else None
        assert sink.tokens() == expected[task_id, prompt], (task_id, prompt)
    # They ran together: one decode forward held every adapter and the base.
    assert max(len(set(f)) for f in forwards) == len(adapters) + 1


def record_decode_adapters(runner, monkeypatch) -> list[list]:
    """Each decode forward's adapter task ids per row (None: the base)."""
    forwards = []
    decode = runner.decode

    def recording(cache, token_ids, positions, adapters=None):
        forwards.append([a.task_id if a else None for a in adapters or []])
        return decode(cache, token_ids, positions, adapters)

    monkeypatch.setattr(runner, "decode", recording)
    return forwards


def test_an_unknown_task_id_is_tensorrt_llms_cache_miss(engine, tokenizer, adapters, expected):
    adapter = adapters[0]
    with pytest.raises(InvalidRequest) as miss:
        engine.submit(lora_request(tokenizer, PROMPTS[0], adapter, with_weights=False), None)
    assert str(miss.value) == contract.lora_cache_miss(adapter.task_id)
    assert contract.LORA_CACHE_MISS.match(str(miss.value))[1] == str(adapter.task_id)
    # The caller resends with the weights; later requests send the id alone.
    run(engine, [lora_request(tokenizer, PROMPTS[0], adapter)])
    (sink,) = run(engine, [lora_request(tokenizer, PROMPTS[1], adapter, with_weights=False)])
    assert sink.tokens() == expected[adapter.task_id, PROMPTS[1]]


def test_weights_without_a_task_id_are_refused(engine, tokenizer, adapters):
    req = lora_request(tokenizer, PROMPTS[0], adapters[0])
    req = replace(req, lora_task_id=None)
    with pytest.raises(InvalidRequest, match="without lora_task_id"):
        engine.submit(req, CollectingSink())


def engine_bytes(adapter, runner) -> int:
    """What the engine holds for an adapter: its unpacked weights in float32."""
    shapes, layers = runner.lora.module_shapes()
    return 4 * sum(d.a.size + d.b.size for d in unpack(adapter.tensors, shapes, layers))


def test_eviction_keeps_answers_right_within_the_budget(runner, tokenizer, adapters, expected):
    used = adapters[:4]
    budget = sum(sorted(engine_bytes(a, runner) for a in used)[-2:])  # any 2 of the 4 fit
    engine = new_engine(runner, lora_cache_bytes=budget)
    misses = 0
    try:
        for _ in range(2):
            for adapter in used:
                # As a caller does: the id alone, and the weights after a cache miss.
                try:
                    (sink,) = run(engine, [lora_request(tokenizer, PROMPTS[0], adapter, False)])
                except InvalidRequest as miss:
                    assert str(miss) == contract.lora_cache_miss(adapter.task_id)
                    misses += 1
                    (sink,) = run(engine, [lora_request(tokenizer, PROMPTS[0], adapter)])
                assert sink.tokens() == expected[adapter.task_id, PROMPTS[0]]
                assert engine.adapters.resident_bytes <= budget
        assert misses == 8  # used in turn, 4 adapters through room for 2: always evicted
    finally:
        engine.shutdown()


def test_an_adapter_in_use_is_never_evicted(runner, tokenizer, adapters):
    first, second, third = adapters[:3]
    sizes = [engine_bytes(a, runner) for a in (first, second, third)]
    # The first two fit; the third fits only in place of one of them.
    budget = max(sizes[0] + sizes[1], sizes[2] + max(sizes[:2]))
    engine = new_engine(runner, lora_cache_bytes=budget)
    try:
        sinks = [CollectingSink(), CollectingSink()]
        for adapter, sink in zip((first, second), sinks, strict=True):
            long = lora_request(tokenizer, PROMPTS[0], adapter, rid=str(adapter.task_id))
            engine.submit(replace(long, max_tokens=400), sink)
        with pytest.raises(EngineBusy, match="^Cache is full. There are no done tasks to evict$"):
            engine.submit(lora_request(tokenizer, PROMPTS[0], third), CollectingSink())
        for adapter in (first, second):
            engine.cancel(str(adapter.task_id))
        for sink in sinks:
            assert sink.done.wait(60)
        # Done now: the least recently used one makes room.
        (sink,) = run(engine, [lora_request(tokenizer, PROMPTS[0], third)])
        assert first.task_id not in engine.adapters and third.task_id in engine.adapters
    finally:
        engine.shutdown()


def test_an_adapter_of_another_base_is_refused(engine, tokenizer, tmp_path):
    base = other_base(tmp_path / "base")
    stranger = make_adapter(base, SPECS[1], 0, tmp_path / "adapter", task_id=77)
    with pytest.raises(InvalidRequest, match="another base"):
        engine.submit(lora_request(tokenizer, PROMPTS[0], stranger), CollectingSink())
    assert 77 not in engine.adapters


def test_a_rank_over_max_lora_rank_is_refused(runner, tokenizer, adapters):
    engine = new_engine(runner, max_lora_rank=8)
    try:
        with pytest.raises(InvalidRequest, match="rank 16.*up to 8$"):
            engine.submit(lora_request(tokenizer, PROMPTS[0], adapters[2]), CollectingSink())
    finally:
        engine.shutdown()


def test_the_prefix_cache_keeps_adapters_apart(runner, tokenizer, adapters, expected):
    engine = new_engine(runner, prefix_cache_mb=4, prefix_block_size=2)
    adapter, prompt = adapters[1], PROMPTS[2]
    try:
        (base,) = run(engine, [lora_request(tokenizer, prompt)])
        (base_again,) = run(engine, [lora_request(tokenizer, prompt)])
        assert base_again.chunks[0].num_cached_tokens > 0  # the base shares with itself
        (first,) = run(engine, [lora_request(tokenizer, prompt, adapter)])
        assert first.chunks[0].num_cached_tokens == 0  # not the base's keys and values
        assert first.tokens() == expected[adapter.task_id, prompt]
        (again,) = run(engine, [lora_request(tokenizer, prompt, adapter, False)])
        assert again.chunks[0].num_cached_tokens > 0  # its own prefix, reused
        assert again.tokens() == expected[adapter.task_id, prompt]
        assert base.tokens() == base_again.tokens() == expected[None, prompt]
    finally:
        engine.shutdown()


def test_an_empty_adapter_is_refused(engine, tokenizer, adapters):
    empty = replace(adapters[0].tensors, weights=np.zeros((0, 0), np.float16))
    empty = replace(empty, config=np.zeros((0, 3), np.int32))
    req = replace(lora_request(tokenizer, PROMPTS[0], adapters[0]), lora=empty, lora_task_id=5)
    with pytest.raises(InvalidRequest, match="no weights"):
        engine.submit(req, CollectingSink())


def test_lora_tensors_are_read_from_a_request(adapters):
    adapter = adapters[0]
    tensors = {
        "input_ids": np.array([[5, 6, 7]], dtype=np.int32),
        "request_output_len": np.array([[4]], dtype=np.int32),
        **adapter.lora_inputs(),
    }
    req = to_generation_request("r", tensors.get)
    assert req.lora_task_id == adapter.task_id
    assert np.array_equal(req.lora.weights, adapter.tensors.weights)
    assert np.array_equal(req.lora.config, adapter.tensors.config)
    del tensors["lora_config"]
    with pytest.raises(InvalidRequest, match="lora_weights and lora_config must be sent together"):
        to_generation_request("r", tensors.get)
    del tensors["lora_weights"]
    req = to_generation_request("r", tensors.get)
    assert (req.lora_task_id, req.lora) == (adapter.task_id, None)
