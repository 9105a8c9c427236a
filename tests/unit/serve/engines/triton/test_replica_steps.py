"""The replica's own tokenize and detokenize steps (serve/engines/triton/steps.py), without Triton:
the engine step's tensors as the ensemble would feed them, read from its config."""

from __future__ import annotations

import numpy as np
import pytest

from serve.engines.triton.steps import ReplicaSteps, StepsUnsupported, read_steps
from serve.generation import GenerateParams, GenerationError
from tritonllm import contract
from tritonllm.preprocess import preprocess


@pytest.fixture(scope="module")
def steps(built_repository) -> ReplicaSteps:
    return ReplicaSteps.load(built_repository, contract.ENSEMBLE)


def test_the_engine_gets_the_contracts_tensors_with_their_types(steps, tokenizer):
    params = GenerateParams(
        "The cat sat", 7, temperature=0.5, top_k=3, seed=9, stop=(" mat",), logit_bias=((5, 2.0),)
    )
    inputs = steps.inputs(params)
    for name, array in inputs.items():
        spec = contract.tensor(contract.TENSORRT_LLM, name)
        assert array.dtype == spec.numpy_dtype, name
        assert array.ndim == len(spec.dims) + 1, name  # batch first
    required = {t.name for t in contract.TENSORRT_LLM_INPUTS if not t.optional}
    assert required <= set(inputs)
    # What the preprocessing model makes of the same prompt, under the ensemble's names.
    expected = preprocess(tokenizer, np.array([[b"The cat sat"]], dtype=object), [[7]])
    assert inputs["input_ids"].tolist() == expected["INPUT_ID"].tolist()
    assert inputs["input_lengths"].tolist() == expected["REQUEST_INPUT_LEN"].tolist()
    assert inputs["request_output_len"].tolist() == [[7]]
    assert inputs["runtime_top_k"].tolist() == [[3]]  # the ensemble's top_k, renamed
    assert inputs["streaming"].tolist() == [[True]]
    stop_ids = tokenizer.encode(" mat", add_special_tokens=False)
    assert inputs["stop_words_list"][0, 0, : len(stop_ids)].tolist() == stop_ids
    assert inputs["embedding_bias"][0, 5] == 2.0


def test_a_token_id_prompt_goes_as_it_is(steps):
    inputs = steps.inputs(GenerateParams("", 3, prompt_token_ids=(1, 2, 3), resumed_tokens=1))
    assert inputs["input_ids"].tolist() == [[1, 2, 3]]
    assert inputs["resumed_output_len"].tolist() == [[1]]


def test_the_preprocessings_refusal_is_the_clients_error(steps):
    with pytest.raises(GenerationError, match="max_tokens must be > 0") as info:
        steps.inputs(GenerateParams("The cat", 0))
    assert info.value.kind == GenerationError.INVALID


def test_each_request_detokenizes_on_its_own(steps, tokenizer):
    ids = tokenizer.encode("Grüße aus dem Süden", add_special_tokens=False)
    reader = steps.reader(GenerateParams("x", len(ids)))
    text = "".join(
        reader.chunk({"output_ids": np.array([[[token]]], dtype=np.int32)}).text for token in ids
    )
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert steps.reader(GenerateParams("x", 1)).detokenizer is not reader.detokenizer


def test_a_model_that_is_no_such_ensemble_is_refused(built_repository):
    # The replica then sends its requests to that model as configured (triton_model).
    with pytest.raises(StepsUnsupported, match=r"steps are \[\]"):
        read_steps(built_repository, contract.TENSORRT_LLM)
