"""Log probabilities, logit bias and the prefix cache's count through the real Triton
server (the ensemble on the default repository), against transformers' own forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serve.engines.triton.client import generate
from tritonllm import contract

pytestmark = pytest.mark.integration

PROMPT = "Where is the old man? The teacher"
K = 5


def forward_log_probs(hf_model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]``: the log-softmax after each token, one forward pass."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def outputs(result, name: str, axis: int = -1) -> np.ndarray:
    """``name`` of every response that carries it (batch dimension dropped), joined
    along ``axis``: the tokens' (-1 for ids and log probs, 0 for [tokens, k] tables)."""
    return np.concatenate([r[name][0] for r in result.responses if name in r], axis=axis)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 50, "seed": 7}],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_log_probs_and_top_k_equal_a_transformers_forward_pass(
    triton, tokenizer, hf_model, sampling, stream
):
    result = generate(
        triton.grpc_url,
        PROMPT,
        max_tokens=12,
        stream=stream,
        exclude_input_in_output=True,
        return_log_probs=True,
        num_top_log_probs=K,
        return_prompt_log_probs=True,
        end_id=-1,  # 12 tokens whatever the model says: more positions to compare
        **sampling,
    )
    prompt_ids = outputs(result, "prompt_token_ids").tolist()
    generated = outputs(result, "output_ids").reshape(-1).tolist()
    assert prompt_ids == tokenizer.encode(PROMPT) and len(generated) == 12
    reference = forward_log_probs(hf_model, prompt_ids + generated)
    # Position i's row predicts token i + 1: the prompt's tokens after the first, then
    # every generated one.
    predicted = reference[:-1].gather(1, torch.tensor(prompt_ids[1:] + generated)[:, None])
    prompt_chosen = outputs(result, "prompt_log_probs")[1:]
    chosen = outputs(result, "output_log_probs").reshape(-1)
    np.testing.assert_allclose(prompt_chosen, predicted[: len(prompt_ids) - 1, 0], atol=1e-4)
    np.testing.assert_allclose(chosen, predicted[len(prompt_ids) - 1 :, 0], atol=1e-4)
    top_values, top_ids = torch.topk(reference[:-1], K, dim=-1)
    prompt_top = outputs(result, "prompt_top_log_probs", 0)[1:]  # [prompt - 1, K]
    top = outputs(result, "top_log_probs", 0)  # [12, K]
    np.testing.assert_allclose(np.concatenate([prompt_top, top]), top_values, atol=1e-4)
    prompt_top_ids = outputs(result, "prompt_top_token_ids", 0)[1:]
    ids = np.concatenate([prompt_top_ids, outputs(result, "top_token_ids", 0)])
    assert (ids == top_ids.numpy()).mean() > 0.99  # ties may order differently


@pytest.mark.parametrize("stream", [False, True])
def test_the_end_tokens_log_probability_comes_last_with_finish_reason_end_id(
    triton, tokenizer, hf_model, stream
):
    """The contract's FINISH_END_ID: output_ids leave the end token out (as TensorRT-LLM
    does), the log-probability outputs hold it last, as a transformers forward pass."""
    prompt = "The cat sat on the mat."  # greedy: a few words, then the end token
    result = generate(
        triton.grpc_url,
        prompt,
        max_tokens=40,
        stream=stream,
        exclude_input_in_output=True,
        return_log_probs=True,
        num_top_log_probs=K,
    )
    generated = outputs(result, "output_ids").reshape(-1).tolist()
    end = tokenizer.eos_token_id
    assert int(outputs(result, "finish_reason")[-1]) == contract.FINISH_END_ID
    assert (
        end not in generated and int(outputs(result, "num_output_tokens")[-1]) == len(generated) + 1
    )
    chosen = outputs(result, "output_log_probs").reshape(-1)
    top_ids = outputs(result, "top_token_ids", 0)
    assert len(chosen) == len(top_ids) == len(generated) + 1
    row = forward_log_probs(hf_model, tokenizer.encode(prompt) + generated)[-1]
    np.testing.assert_allclose(chosen[-1], float(row[end]), atol=1e-4)
    assert top_ids[-1][0] == end  # greedy: the most likely token


def test_embedding_bias_forces_and_bans_tokens(triton, tokenizer, hf_model):
    free = generate(triton.grpc_url, PROMPT, 6, end_id=-1, exclude_input_in_output=True)
    free_ids = outputs(free, "output_ids").reshape(-1).tolist()

    def biased(token: int, weight: float) -> list[int]:
        result = generate(
            triton.grpc_url,
            PROMPT,
            6,
            end_id=-1,
            exclude_input_in_output=True,
            embedding_bias_token_ids=np.array([[token]], dtype=np.int32),
            embedding_bias_weights=np.array([[weight]], dtype=np.float32),
        )
        return outputs(result, "output_ids").reshape(-1).tolist()

    forced = tokenizer.encode(" river", add_special_tokens=False)[0]
    assert biased(forced, 100.0) == [forced] * 6
    banned = biased(free_ids[0], -100.0)
    assert free_ids[0] not in banned and banned != free_ids


def test_bad_embedding_bias_is_refused_and_the_server_serves_on(triton):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="outside the vocabulary"):
        generate(
            triton.grpc_url,
            PROMPT,
            4,
            embedding_bias_token_ids=np.array([[10**6]], dtype=np.int32),
            embedding_bias_weights=np.array([[1.0]], dtype=np.float32),
        )
    assert generate(triton.grpc_url, PROMPT, 4).text


def test_a_repeated_prompt_reports_its_cached_tokens(triton, tokenizer):
    prompt = " ".join(["The teacher sends a long letter to the robot near the sea."] * 6)
    first = generate(triton.grpc_url, prompt, 2, exclude_input_in_output=True)
    again = generate(triton.grpc_url, prompt, 2, exclude_input_in_output=True)
    cached = [int(outputs(r, "num_cached_tokens")[0]) for r in (first, again)]
    length = len(tokenizer.encode(prompt))
    assert cached[0] == 0 and length - 16 <= cached[1] < length  # whole 16-token blocks
