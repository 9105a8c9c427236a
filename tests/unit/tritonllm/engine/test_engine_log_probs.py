"""The torch engine's log probabilities, alternatives and logit bias against transformers'
own forward pass, in a mixed batch, on the CPU and (where torch sees one) on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPOSITORY
from tests.unit.tritonllm.engine.test_engine import CollectingSink
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.runner import CausalLMRunner
from tritonllm.engine.sampling import SamplingParams
from tritonllm.engine.scheduler import Engine

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]
PROMPTS = ["Where is the old man? The teacher", "The cat", "A robot builds many requests"]
K = 4


@pytest.fixture(scope="module")
def checkpoint(request):
    """The default checkpoint: as built (a GPU box gets it copied), else built now."""
    built = REPOSITORY / "tensorrt_llm" / "1" / "hf_model"
    return built if (built / "config.json").is_file() else request.getfixturevalue("checkpoint_dir")


@pytest.fixture(scope="module", params=DEVICES)
def setup(request, checkpoint):
    """An engine (float32, so that it can match transformers closely) with the prefix
    cache and chunked context on, the same model for the reference, and its tokenizer."""
    from transformers import AutoModelForCausalLM

    from tritonllm.tokenization import load_tokenizer

    device = request.param
    runner = CausalLMRunner(checkpoint, device=device, dtype="float32")
    engine = Engine(
        runner,
        max_batch_size=4,
        prefix_cache_mb=8,
        enable_chunked_context=True,
        max_num_tokens=12,  # a prompt of the mix takes several steps
    )
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device)
    yield engine, model.eval(), load_tokenizer(str(checkpoint))
    engine.shutdown()


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def submit(engine, tokenizer, rid: str, prompt: str, **kwargs) -> CollectingSink:
    sink = CollectingSink()
    request = GenerationRequest(
        request_id=rid,
        input_ids=tuple(tokenizer.encode(prompt)),
        max_tokens=kwargs.pop("max_tokens", 10),
        end_id=kwargs.pop("end_id", -1),
        exclude_input_in_output=True,
        return_log_probs=True,
        num_top_log_probs=K,
        **kwargs,
    )
    engine.submit(request, sink)
    return sink


def test_prompt_and_generated_log_probs_equal_a_forward_pass_in_a_mixed_batch(setup):
    engine, model, tokenizer = setup
    sampled = SamplingParams(temperature=1.0, seed=3)
    sinks = [
        submit(engine, tokenizer, f"r{i}", p, return_prompt_log_probs=i == 0, sampling=sampled)
        for i, p in enumerate(PROMPTS)
    ]
    worst = 0.0
    for prompt, sink in zip(PROMPTS, sinks, strict=True):
        assert sink.done.wait(60) and not sink.errors
        generated = sink.tokens()
        prompt_ids = tokenizer.encode(prompt)
        table = reference(model, prompt_ids + generated)
        rows = table[len(prompt_ids) - 1 : -1]  # the rows that predicted each generated token
        chosen = [p for c in sink.chunks for p in c.log_probs]
        expected = rows.gather(1, torch.tensor(generated)[:, None])[:, 0]
        worst = max(worst, float((torch.tensor(chosen) - expected).abs().max()))
        top = [t for c in sink.chunks for t in c.top_log_probs]
        values, ids = torch.topk(rows, K, dim=-1)
        worst = max(worst, float((torch.tensor([t.top_values for t in top]) - values).abs().max()))
        assert [list(t.top_ids) for t in top] == ids.tolist()
    first = sinks[0].chunks[0]
    prompt_ids = tokenizer.encode(PROMPTS[0])
    assert (
        first.prompt_ids == tuple(prompt_ids) and len(first.prompt_log_probs) == len(prompt_ids) - 1
    )
    table = reference(model, prompt_ids)
    expected = table[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]
    got = torch.tensor([p.chosen for p in first.prompt_log_probs])
    worst = max(worst, float((got - expected).abs().max()))
    assert worst < 1e-4, f"largest difference from transformers: {worst:.2e}"


def test_logit_bias_forces_and_bans_tokens_in_a_mixed_batch(setup):
    engine, _, tokenizer = setup
    river = tokenizer.encode(" river", add_special_tokens=False)[0]
    free = submit(engine, tokenizer, "free", PROMPTS[1], max_tokens=5)
    forced = submit(
        engine, tokenizer, "forced", PROMPTS[1], max_tokens=5,
        sampling=SamplingParams(logit_bias=((river, 100.0),)),
    )  # fmt: skip
    assert free.done.wait(60) and forced.done.wait(60)
    assert forced.tokens() == [river] * 5
    first = free.tokens()[0]
    banned = submit(
        engine, tokenizer, "banned", PROMPTS[1], max_tokens=5,
        sampling=SamplingParams(logit_bias=((first, -100.0),)),
    )  # fmt: skip
    assert banned.done.wait(60) and banned.tokens()[0] != first


def test_the_second_of_two_equal_prompts_reports_its_cached_tokens(setup):
    engine, _, tokenizer = setup
    prompt = " ".join(["The teacher sends a long letter to the robot near the sea."] * 3)
    counts = []
    for rid in ("first", "again"):
        sink = submit(engine, tokenizer, rid, prompt, max_tokens=2)
        assert sink.done.wait(60)
        counts.append(sink.chunks[0].num_cached_tokens)
    length = len(tokenizer.encode(prompt))
    assert counts[0] == 0 and length - 16 <= counts[1] < length


@pytest.mark.parametrize("streaming", [False, True])
def test_the_end_tokens_log_probability_comes_last_and_equals_a_forward_pass(setup, streaming):
    """The end token is counted and logged (its log probability and alternatives, as
    vLLM returns them) but never among the tokens, as TensorRT-LLM leaves it out."""
    engine, model, tokenizer = setup
    prompt = "The cat sat on the mat."  # greedy: a few words, then the end token
    end = tokenizer.eos_token_id
    sink = submit(engine, tokenizer, "ends", prompt, max_tokens=40, end_id=end, streaming=streaming)
    assert sink.done.wait(60) and not sink.errors
    last = sink.chunks[-1]
    generated = sink.tokens()
    assert last.finish_reason == "stop" and last.ended_by_end_id and end not in generated
    assert last.num_output_tokens == len(generated) + 1
    log_probs = [p for c in sink.chunks for p in c.log_probs]
    top = [t for c in sink.chunks for t in c.top_log_probs]
    assert len(log_probs) == len(top) == len(generated) + 1
    prompt_ids = tokenizer.encode(prompt)
    row = reference(model, prompt_ids + generated)[-1]  # the row that chose the end token
    assert log_probs[-1] == pytest.approx(float(row[end]), abs=1e-4)
    assert top[-1].top_ids[0] == end  # greedy: the most likely one
    assert last.cum_log_prob == pytest.approx(sum(log_probs), abs=1e-4)
