import pytest
import torch

from tritonllm.engine.sampling import SamplingParams, TokenSampler, log_probs
from tritonllm.tokenization import InvalidRequest

LOGITS = torch.tensor([0.1, 2.0, 1.5, -1.0, 0.5])
HISTORY = torch.tensor([0, 3])


def test_unset_parameters_mean_greedy_as_in_tensorrt_llm():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_p=0.9).greedy
    assert SamplingParams(top_k=1, temperature=1.0).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert TokenSampler(SamplingParams(), end_id=None)(LOGITS, HISTORY, 0) == 1


def test_same_seed_same_tokens():
    params = SamplingParams(temperature=1.0, seed=1234)
    sampler_a, sampler_b = TokenSampler(params, None), TokenSampler(params, None)
    seq_a = [sampler_a(LOGITS, HISTORY, i) for i in range(50)]
    seq_b = [sampler_b(LOGITS, HISTORY, i) for i in range(50)]
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_top_k_restricts_the_choice():
    sampler = TokenSampler(SamplingParams(temperature=1.0, top_k=2, seed=0), None)
    assert {sampler(LOGITS, HISTORY, i) for i in range(200)} == {1, 2}


def test_min_tokens_blocks_the_end_id():
    sampler = TokenSampler(SamplingParams(min_tokens=2), end_id=1)
    assert sampler(LOGITS, HISTORY, 0) == 2
    assert sampler(LOGITS, HISTORY, 2) == 1


def test_sampling_leaves_the_models_logits_alone():
    logits = LOGITS.clone()
    TokenSampler(SamplingParams(min_tokens=5, presence_penalty=1.0), end_id=1)(logits, HISTORY, 1)
    assert torch.equal(logits, LOGITS)


def test_bad_words_are_never_chosen():
    sampler = TokenSampler(SamplingParams(bad_words=((1,), (3, 2))), end_id=None)
    assert sampler(LOGITS, HISTORY, 0) == 4  # 1 banned, 2 banned after 3


def test_repetition_and_presence_penalties_change_the_choice():
    history = torch.tensor([1])
    assert TokenSampler(SamplingParams(repetition_penalty=10.0), None)(LOGITS, history, 1) == 2
    assert TokenSampler(SamplingParams(presence_penalty=1.0), None)(LOGITS, history, 1) == 2
    assert TokenSampler(SamplingParams(frequency_penalty=1.0), None)(LOGITS, history, 1) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": 1.5},
        {"top_k": -2},
        {"repetition_penalty": 0},
        {"min_tokens": -1},
    ],
)
def test_invalid_parameters_are_rejected(kwargs):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kwargs)


def test_logit_bias_forces_and_bans_tokens():
    forced = TokenSampler(SamplingParams(logit_bias=((3, 100.0),)), end_id=None)
    assert forced(LOGITS, HISTORY, 0) == 3
    banned = TokenSampler(SamplingParams(logit_bias=((1, -100.0),)), end_id=None)
    assert banned(LOGITS, HISTORY, 0) == 2
    sampled = TokenSampler(SamplingParams(temperature=1.0, seed=0, logit_bias=((4, 100.0),)), None)
    assert {sampled(LOGITS, HISTORY, i) for i in range(50)} == {4}


def test_log_probs_are_the_models_own_with_the_most_likely_alternatives():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    table = torch.log_softmax(logits, -1)
    first, second = log_probs(logits, [3, 0], k=2)
    assert first.chosen == pytest.approx(float(table[0, 3]))
    assert first.top_ids == (1, 2) and second.top_ids == (3, 2)
    assert first.top_values == pytest.approx(tuple(table[0, [1, 2]].tolist()))
    assert log_probs(logits, [3, 0], k=0)[1].top_ids == ()
