"""A request resumed where another replica lost it (``resumed_output_len``), in the torch
engine on the real model: its answer's rest equals the uncut answer's, for seeded
sampling, presence and frequency penalties and a guide alike."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.unit.tritonllm.engine.test_engine import DTYPE, CollectingSink
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.sampling import SamplingParams
from tritonllm.engine.scheduler import Engine
from tritonllm.tokenization import InvalidRequest

PROMPT = "<|user|>Tell me about the sea.<|assistant|>"
TOKENS = 40
CUT = 13
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "tags"],
}

CASES = {
    "seeded sampling": {"sampling": SamplingParams(temperature=1.0, top_p=0.95, seed=11)},
    "penalties": {"sampling": SamplingParams(presence_penalty=1.5, frequency_penalty=0.7)},
    "seeded penalties": {"sampling": SamplingParams(temperature=0.8, seed=5, presence_penalty=1.0)},
    "guided": {
        "sampling": SamplingParams(temperature=1.0, seed=3),
        "guide_type": "json_schema",
        "guide": json.dumps(SCHEMA),
    },
}


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    engine = Engine(CausalLMRunner(checkpoint_dir, dtype=DTYPE), max_batch_size=4)
    yield engine
    engine.shutdown()


def generate(engine, request: GenerationRequest) -> list[int]:
    sink = CollectingSink()
    engine.submit(request, sink)
    assert sink.done.wait(120), "no final response"
    assert not sink.errors, sink.errors
    return sink.tokens()


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_continues_the_uncut_answer(engine, tokenizer, case):
    uncut = GenerationRequest(
        request_id=f"uncut-{case}",
        input_ids=tuple(tokenizer.encode(PROMPT)),
        max_tokens=TOKENS,
        end_id=-1,  # no end token: TOKENS of them whatever the model
        exclude_input_in_output=True,
        **CASES[case],
    )
    answer = generate(engine, uncut)
    cut = 4 if case == "guided" else CUT  # the grammar may end the answer soon: mid-JSON
    assert len(answer) >= cut + 3, answer
    resumed = dataclasses.replace(
        uncut,
        request_id=f"resumed-{case}",
        input_ids=uncut.input_ids + tuple(answer[:cut]),
        max_tokens=TOKENS - cut,
        resumed_output_len=cut,
    )
    assert generate(engine, resumed) == answer[cut:]
    # Without it the engine would start the answer afresh: the check can fail.
    if case != "guided":
        plain = dataclasses.replace(resumed, request_id=f"plain-{case}", resumed_output_len=0)
        assert generate(engine, plain) != answer[cut:]


def test_resumed_output_longer_than_the_input_is_refused(engine, tokenizer):
    request = GenerationRequest(
        request_id="too-long", input_ids=(5, 6, 7), max_tokens=4, resumed_output_len=3
    )
    with pytest.raises(InvalidRequest, match=r"resumed_output_len must be in \[0, 3\)"):
        engine.submit(request, CollectingSink())


def test_resumed_output_outside_the_guide_is_refused(engine, tokenizer):
    ids = tuple(tokenizer.encode(PROMPT)) + tuple(tokenizer.encode("no JSON"))
    request = GenerationRequest(
        request_id="off-grammar",
        input_ids=ids,
        max_tokens=4,
        guide_type="json_schema",
        guide=json.dumps(SCHEMA),
        resumed_output_len=len(tokenizer.encode("no JSON")),
    )
    sink = CollectingSink()  # the guide compiles off the loop: the refusal comes after it
    engine.submit(request, sink)
    assert sink.done.wait(30) and not sink.chunks and sink.codes == ["INVALID_ARG"]
    assert "leaves the guide's grammar at its token 0" in sink.errors[0]
