"""Prefix caching in the torch engine: the block pool alone, then the real engine with
the cache on against transformers' generate() and against the engine with it off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.reference import hf_greedy
from tests.unit.tritonllm.engine.test_engine import CollectingSink, RecordingObserver
from tritonllm.engine.kv_cache import SlotKVCache
from tritonllm.engine.prefix_cache import PrefixCache
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.sampling import SamplingParams
from tritonllm.engine.scheduler import Engine

BLOCK = 4


def pool(num_blocks: int) -> tuple[PrefixCache, SlotKVCache]:
    cache = SlotKVCache(2, 2, 1, 2, 64, torch.float32, torch.device("cpu"))
    return PrefixCache(cache, num_blocks, BLOCK), cache


def fill(cache: SlotKVCache, slot: int, tokens: list[int]) -> None:
    """Keys and values that name their token: a copy in the wrong place shows."""
    for layer, (keys, values) in enumerate(cache.row_views(slot, len(tokens))):
        keys.copy_(torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand_as(keys))
        values.copy_(keys + 1000 * (layer + 1))


def test_match_finds_the_longest_cached_prefix_of_whole_blocks_and_never_the_last_token():
    prefix, cache = pool(8)
    tokens = list(range(1, 11))  # 2 whole blocks and 2 tokens
    fill(cache, 0, tokens)
    prefix.save(cache, 0, tokens)
    assert prefix.cached_blocks == 2
    assert len(prefix.match(tokens)) == 2
    assert len(prefix.match(tokens[:8])) == 1  # the 8th token must be prefilled
    assert len(prefix.match([*tokens[:4], 99, *tokens[5:]])) == 1  # differs in block 2
    assert prefix.match([99, *tokens[1:]]) == []  # same block 2, other prefix: no hit
    chain = prefix.match(tokens)
    assert prefix.load(cache, 1, chain) == 8
    for layer, (keys, values) in enumerate(cache.row_views(1, 8)):
        assert keys[0, :, 0].tolist() == tokens[:8]
        assert values[0, :, 0].tolist() == [t + 1000 * (layer + 1) for t in tokens[:8]]


def test_least_recently_used_leaves_go_first_and_the_pool_never_outgrows_its_budget():
    prefix, cache = pool(4)
    a, b = list(range(1, 13)), list(range(101, 109))  # 3 blocks, 2 blocks
    fill(cache, 0, a)
    prefix.save(cache, 0, a)
    fill(cache, 1, b)
    prefix.save(cache, 1, b)  # 5 blocks wanted, 4 held: a's last block (a leaf) goes
    assert prefix.cached_blocks == 4
    assert len(prefix.match([*a, 0])) == 2 and len(prefix.match([*b, 0])) == 2
    c = list(range(201, 213))
    fill(cache, 0, c)
    prefix.save(cache, 0, c)  # b was used last, a before it: a's blocks go
    assert prefix.match([*a, 0]) == [] and len(prefix.match([*b, 0])) == 1
    chain = prefix.match([*c, 0])
    prefix.load(cache, 1, chain)
    assert cache.row_views(1, 4 * len(chain))[0][0][0, :, 0].tolist() == c[: 4 * len(chain)]


def test_a_prefix_longer_than_the_pool_keeps_its_first_blocks():
    prefix, cache = pool(2)
    tokens = list(range(1, 21))  # 5 blocks
    fill(cache, 0, tokens)
    prefix.save(cache, 0, tokens)
    assert len(prefix.match(tokens)) == 2


def test_budget_in_mib_sizes_the_pool():
    cache = SlotKVCache(2, 2, 1, 2, 64, torch.float32, torch.device("cpu"))
    assert cache.bytes_per_token() == 2 * 2 * 1 * 2 * 4  # keys and values, 2 layers
    assert PrefixCache.for_budget(cache, 1, 16).num_blocks == 2**20 // (32 * 16)
    assert PrefixCache.for_budget(cache, 1e-6, 16) is None


# -- the engine -----------------------------------------------------------------

SYSTEM = (
    "The robot writes a long letter to the old town, and the teacher reads it every "
    "morning by the window. Many small servers answer requests near the sea. "
)
QUESTIONS = ["Where is the cat?", "Why", "The old man", "日本語は", "Hello there, robot"]


@pytest.fixture(scope="module")
def runner(checkpoint_dir):
    return CausalLMRunner(checkpoint_dir, device="cpu")


@pytest.fixture
def engines(runner):
    made = []

    def make(**kwargs):
        kwargs.setdefault("prefix_block_size", BLOCK)
        made.append(Engine(runner, max_batch_size=4, max_queue_size=32, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


def run(engine, prompts, max_tokens=12, each=lambda i: {}) -> list[list[int]]:
    """Submit all at once (they share steps); each one's generated ids. A prompt is
    token ids; ``each(i)`` overrides fields of request ``i``."""
    sinks = []
    for i, prompt in enumerate(prompts):
        sinks.append(CollectingSink())
        req = GenerationRequest(
            str(i), tuple(prompt), max_tokens, end_id=0, exclude_input_in_output=True
        )
        engine.submit(dataclasses.replace(req, **each(i)), sinks[-1])
    for sink in sinks:
        assert sink.done.wait(60) and not sink.errors
    return [sink.tokens() for sink in sinks]


def test_turns_sharing_a_prefix_hit_the_cache_and_equal_generate(engines, tokenizer, hf_model):
    observer = RecordingObserver()
    engine = engines(prefix_cache_mb=4, observer=observer)
    texts = [SYSTEM + q for q in QUESTIONS]
    prompts = [tokenizer.encode(t) for t in texts]
    first = run(engine, prompts[:1])
    rest = run(engine, prompts[1:], each=lambda i: {"streaming": i % 2 == 0})
    for text, tokens in zip(texts, first + rest, strict=True):
        assert tokens == hf_greedy(hf_model, tokenizer, text, 12, end_id=0)
    system_blocks = len(tokenizer.encode(SYSTEM)) // BLOCK
    hits = sum(s.prefix_hit_tokens for s in observer.steps)
    assert hits >= len(rest) * (system_blocks - 1) * BLOCK  # each later turn skipped it
    queried = sum(s.prefix_queried_tokens for s in observer.steps)
    assert queried == sum(len(p) for p in prompts)
    assert sum(s.prefill_tokens for s in observer.steps) == queried - hits


def test_a_conversation_reuses_its_own_answer(engines, tokenizer):
    """The next turn's prompt holds the last answer: finished sequences feed the cache
    (here from slot rows that grew inside a forward's inference mode)."""
    observer = RecordingObserver()
    on, off = engines(prefix_cache_mb=4, observer=observer), engines()
    system = tokenizer.encode(SYSTEM * 8)  # past the slot rows' first 256 columns: they grow
    assert 256 < len(system) < 400
    (answer,) = run(on, [system], max_tokens=24)
    turn = system + answer + tokenizer.encode("Why", add_special_tokens=False)
    observer.steps.clear()
    assert run(on, [turn], max_tokens=16) == run(off, [turn], max_tokens=16)
    assert sum(s.prefix_hit_tokens for s in observer.steps) > len(system)


def test_outputs_stay_exact_while_a_small_pool_evicts(engines, tokenizer):
    on, off = engines(prefix_cache_mb=12 * BLOCK * 4096 / 2**20), engines()
    assert on._prefix.num_blocks == 12  # 4096 bytes per token of the tiny model
    texts = [f"{q} {SYSTEM}" for q in QUESTIONS]  # ~10 blocks each
    order = [0, 1, 0, 2, 0, 3, 1, 4, 0]  # prompt 0 stays hot, the others push it out
    prompts = [tokenizer.encode(texts[i]) for i in order]
    assert [run(on, [p])[0] for p in prompts] == [run(off, [p])[0] for p in prompts]
    assert on._prefix.cached_blocks == on._prefix.num_blocks  # full: every later save evicted


def test_sampling_that_differs_per_request_is_the_same_with_the_cache_on_and_off(
    engines, tokenizer
):
    prompts = [tokenizer.encode(SYSTEM + q) for q in QUESTIONS]

    def sampling(i):
        params = SamplingParams(temperature=0.7 + 0.1 * i, top_k=5 * i, seed=i)
        return {"sampling": params, "streaming": i % 2 == 1}

    off = run(engines(), prompts, each=sampling)
    on = engines(prefix_cache_mb=4)
    run(on, [tokenizer.encode(SYSTEM + "warm")])  # the prefix is cached before they come
    assert run(on, prompts, each=sampling) == off


def test_chunked_context_with_the_cache_gives_the_same_outputs_and_counts(engines, tokenizer):
    """Chunks start after a cached prefix and after each other; a cancelled or finished
    sequence mid-prompt saves what it has. Streamed, whole and seeded requests."""
    observer = RecordingObserver()
    chunked = engines(
        prefix_cache_mb=4, max_num_tokens=12, enable_chunked_context=True, observer=observer
    )
    prompts = [tokenizer.encode(SYSTEM * 2 + q) for q in QUESTIONS]

    def mixed(i):
        sampling = SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams()
        return {"sampling": sampling, "streaming": i % 3 == 0}

    off = run(engines(), prompts, each=mixed)
    assert run(chunked, prompts[:1], each=mixed) == off[:1]  # then the others hit it
    assert run(chunked, prompts, each=mixed) == off
    assert max(s.prefill_tokens for s in observer.steps) <= 12
    queried = sum(s.prefix_queried_tokens for s in observer.steps)
    hits = sum(s.prefix_hit_tokens for s in observer.steps)
    assert hits > 4 * len(tokenizer.encode(SYSTEM))
    assert sum(s.prefill_tokens for s in observer.steps) == queried - hits
