"""The slot KV cache: batched decode over rows of different lengths equals one-by-one."""

from __future__ import annotations

import pytest
import torch

from tritonllm.engine.kv_cache import SlotKVCache
from tritonllm.engine.runner import CausalLMRunner


@pytest.fixture(scope="module")
def runner(checkpoint_dir):
    return CausalLMRunner(checkpoint_dir, device="cpu")


def alone(runner, ids: list[int]) -> torch.Tensor:
    """Logits after ``ids`` with transformers' own cache, token by token after the first."""
    with torch.inference_mode():
        out = runner.model(input_ids=torch.tensor([ids[:1]]), use_cache=True)
        for token in ids[1:]:
            out = runner.model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return out.logits[0, -1]


def test_batched_prefill_and_decode_of_ragged_rows_equal_each_sequence_alone(runner):
    prompts = [[1, 5, 9, 14], [1, 7], [1, 3, 3, 8, 20, 11, 6], [1]]
    cache = runner.new_cache(num_slots=4, max_len=64)
    first = runner.prefill(cache, [2, 0, 3, 1], prompts)  # one right-padded forward
    for ids, logits in zip(prompts, first, strict=True):
        torch.testing.assert_close(logits, alone(runner, ids))
    prompts = [prompts[1], prompts[3], prompts[0], prompts[2]]  # in slot order
    histories = [list(p) for p in prompts]
    for step in range(5):  # rows stay ragged: each appends one token per step
        new = [10 + step + row for row in range(4)]
        logits = runner.decode(cache, new, [len(h) for h in histories])
        for row, token in enumerate(new):
            histories[row].append(token)
            torch.testing.assert_close(logits[row], alone(runner, histories[row]))


def test_growing_and_moving_rows_keep_their_contents(runner):
    cache = SlotKVCache.for_model(runner.model, num_slots=2, max_len=64, initial_len=4)
    ids = list(range(1, 12))
    runner.prefill(cache, [1], [ids])  # 11 columns into a 4-column cache
    assert cache.capacity == 11
    cache.move(1, 0, len(ids))
    logits = runner.decode(cache, [30], [len(ids)])  # column 12: the cache doubles
    assert cache.capacity == 22
    torch.testing.assert_close(logits[0], alone(runner, [*ids, 30]))


def test_a_cache_never_grows_past_max_len(runner):
    cache = runner.new_cache(num_slots=1, max_len=8)
    with pytest.raises(ValueError, match="holds 8"):
        cache.plan_prefill([0], 9)
