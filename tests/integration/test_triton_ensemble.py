"""The real Triton server on the freshly built default repository."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from serve.engines.triton.client import generate
from tests.reference import counted, hf_greedy

pytestmark = pytest.mark.integration

PROMPTS = [
    "The cat",
    "Where is the old man? The teacher",
    "In Zürich the robot sends a long letter to the scheduler near the sea, and then",
    "日本語は難しい。 Привет, мир! Crème brûlée",
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("stream", [False, True])
def test_greedy_output_equals_transformers_generate(triton, tokenizer, hf_model, prompt, stream):
    expected = hf_greedy(hf_model, tokenizer, prompt, max_tokens=24)
    result = generate(
        triton.grpc_url,
        prompt,
        max_tokens=24,
        stream=stream,
        exclude_input_in_output=True,
        temperature=0.0,
    )
    assert result.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert num_output_tokens(result) == counted(expected, 24)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_chunks_join_into_the_non_streamed_text(triton, prompt):
    # end_id = pad keeps the model writing past its first sentence (mixed scripts).
    whole = generate(triton.grpc_url, prompt, max_tokens=40, exclude_input_in_output=True, end_id=0)
    streamed = generate(
        triton.grpc_url, prompt, max_tokens=40, stream=True, exclude_input_in_output=True, end_id=0
    )
    assert len(streamed.chunks) > 1
    assert streamed.text == whole.text
    assert "\ufffd" not in streamed.text


def num_output_tokens(result) -> int:
    return int(result.responses[-1]["num_output_tokens"].reshape(-1)[0])


def text_of(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_output_includes_the_prompt_unless_excluded(triton, tokenizer):
    prompt = "The cat"
    with_prompt = generate(triton.grpc_url, prompt, max_tokens=8)
    without = generate(triton.grpc_url, prompt, max_tokens=8, exclude_input_in_output=True)
    assert with_prompt.text == prompt + without.text


def test_max_tokens_is_honoured(triton):
    for max_tokens in (1, 5, 17):
        result = generate(
            triton.grpc_url,
            "The river",
            max_tokens=max_tokens,
            end_id=0,
            exclude_input_in_output=True,
            return_num_output_tokens=True,
        )
        assert num_output_tokens(result) == max_tokens


def test_end_id_stops_generation_before_that_token(triton, tokenizer, hf_model):
    free_run = hf_greedy(hf_model, tokenizer, "The cat", max_tokens=20, end_id=0)
    stop_token = free_run[5]
    cut = free_run.index(stop_token)
    result = generate(
        triton.grpc_url, "The cat", max_tokens=20, end_id=stop_token, exclude_input_in_output=True
    )
    assert result.text == text_of(tokenizer, free_run[:cut])
    assert num_output_tokens(result) == cut + 1  # the end token counts, unreturned


def test_default_end_id_is_the_tokenizers_eos(triton, tokenizer, hf_model):
    expected = hf_greedy(hf_model, tokenizer, "The cat", max_tokens=40)
    assert len(expected) < 40, "the default model ends its sentences with EOS"
    result = generate(triton.grpc_url, "The cat", max_tokens=40, exclude_input_in_output=True)
    assert result.text == text_of(tokenizer, expected)
    assert num_output_tokens(result) == counted(expected, 40)


def test_stop_word_ends_generation_after_it(triton, tokenizer, hf_model):
    free_run = hf_greedy(hf_model, tokenizer, "The cat", max_tokens=20, end_id=0)
    stop_text = tokenizer.decode(free_run[3:4])
    assert tokenizer.encode(stop_text, add_special_tokens=False) == free_run[3:4]
    first = next(i for i, t in enumerate(free_run) if t == free_run[3])
    for stream in (False, True):
        result = generate(
            triton.grpc_url,
            "The cat",
            max_tokens=20,
            end_id=0,
            stream=stream,
            stop_words=[stop_text],
            exclude_input_in_output=True,
        )
        assert result.text == text_of(tokenizer, free_run[: first + 1])
        assert num_output_tokens(result) == first + 1


@pytest.mark.parametrize(
    ("max_tokens", "optional", "message"),
    [
        (None, {}, "max_tokens"),
        (0, {}, "max_tokens must be > 0"),
        (-3, {}, "max_tokens must be > 0"),
        (16, {"temperature": np.array([[1]], dtype=np.int32)}, "temperature"),
        (16, {"beam_width": 4}, "beam_width"),
        (16, {"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_requests_get_an_error_and_the_server_keeps_serving(
    triton, max_tokens, optional, message
):
    with pytest.raises(InferenceServerException, match=message):
        generate(triton.grpc_url, "The cat", max_tokens=max_tokens, **optional)
    assert generate(triton.grpc_url, "The cat", max_tokens=4).text.startswith("The cat")


def test_prompt_longer_than_the_context_is_rejected(triton, hf_model):
    context = hf_model.config.max_position_embeddings
    prompt = "the cat sees the red ball " * context
    with pytest.raises(InferenceServerException, match="exceeds the maximum sequence length"):
        generate(triton.grpc_url, prompt, max_tokens=4)
    with pytest.raises(InferenceServerException, match="exceeds the maximum sequence length"):
        generate(triton.grpc_url, "The cat", max_tokens=context)
    assert generate(triton.grpc_url, "The cat", max_tokens=4).text.startswith("The cat")


def test_http_generate_endpoint(triton):
    import json
    import urllib.request

    body = json.dumps({"text_input": "The cat", "max_tokens": 6}).encode()
    request = urllib.request.Request(
        f"http://{triton.http_url}/v2/models/ensemble/generate", data=body, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    assert answer["text_output"].startswith("The cat")


def guided(guide_type: str, guide: str) -> dict[str, np.ndarray]:
    return {
        "guided_decoding_guide_type": np.array([[guide_type.encode()]], dtype=object),
        "guided_decoding_guide": np.array([[guide.encode()]], dtype=object),
    }


def test_guided_decoding_reaches_the_engine_through_the_ensemble(triton):
    import json

    import jsonschema

    schema = {
        "type": "object",
        # Bounded (enums, booleans): a finished answer whatever the model writes.
        "properties": {"colour": {"enum": ["red", "green"]}, "bright": {"type": "boolean"}},
        "required": ["colour", "bright"],
    }
    for stream in (False, True):
        result = generate(
            triton.grpc_url,
            "<|user|>A colour in JSON<|assistant|>",
            max_tokens=200,
            stream=stream,
            exclude_input_in_output=True,
            temperature=0.0,
            **guided("json_schema", json.dumps(schema)),
        )
        jsonschema.validate(json.loads(result.text), schema)
    with pytest.raises(InferenceServerException, match="not a valid JSON Schema"):
        generate(triton.grpc_url, "The cat", max_tokens=8, **guided("json_schema", '{"type": 1}'))
    assert generate(triton.grpc_url, "The cat", max_tokens=4).text.startswith("The cat")
