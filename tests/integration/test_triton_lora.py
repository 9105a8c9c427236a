"""LoRA adapters through the real Triton: TensorRT-LLM's tensors sent to the ensemble."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from serve.engines.triton.client import generate
from tests.lora_adapters import SPECS, make_adapter
from tests.reference import hf_greedy
from tritonllm import contract

pytestmark = pytest.mark.integration

PROMPT = "Where is the river?"


def test_weights_then_the_id_alone_then_an_unknown_id(triton, checkpoint_dir, tokenizer, tmp_path):
    adapter = make_adapter(checkpoint_dir, SPECS[1], seed=1, out_dir=tmp_path, task_id=4242)
    expected = tokenizer.decode(
        hf_greedy(adapter.model, tokenizer, PROMPT, 16, end_id=0), skip_special_tokens=True
    )
    options = {"max_tokens": 16, "end_id": 0, "exclude_input_in_output": True}
    first = generate(triton.grpc_url, PROMPT, **options, **adapter.lora_inputs())
    assert first.text == expected
    again = generate(
        triton.grpc_url, PROMPT, stream=True, **options, **adapter.lora_inputs(with_weights=False)
    )
    assert again.text == expected and len(again.chunks) > 1
    base = generate(triton.grpc_url, PROMPT, **options)
    assert base.text != expected
    unknown = np.array([[987654]], dtype=np.uint64)
    with pytest.raises(InferenceServerException) as miss:
        generate(triton.grpc_url, PROMPT, **options, lora_task_id=unknown)
    assert contract.lora_cache_miss(987654) in str(miss.value)
