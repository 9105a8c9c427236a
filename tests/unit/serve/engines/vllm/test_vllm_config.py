"""The vLLM engine's config, its LLMConfig, the sampling translation and vLLM's outputs
as our chunks (no vLLM here: its output types are imitated as vLLM 0.29 shapes them)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from serve.config import ROOT, AppConfig, ModelConfig
from serve.engines.vllm.deployment import llm_config, lora_llm_config, vllm_max_lora_rank
from serve.engines.vllm.params import ChunkReader, sampling_kwargs
from serve.generation import GenerateParams, GenerationChunk, PromptLogProbs, TopLogProbs


def vllm_model(**fields) -> ModelConfig:
    return ModelConfig.model_validate(
        {"id": "v", "engine": "vllm", "vllm": {"checkpoint": "ckpt"}} | fields
    )


def test_the_shipped_two_engine_config_serves_one_checkpoint_under_two_ids():
    config = yaml.safe_load((ROOT / "serve" / "config.vllm.yaml").read_text())
    app = AppConfig.model_validate(config["applications"][0]["args"])
    triton, vllm = app.models
    assert (triton.engine, vllm.engine) == ("triton", "vllm")
    assert vllm.vllm.checkpoint_path() == triton.triton.repository_path() / (
        "tensorrt_llm/1/hf_model"
    )
    assert [m.deployment_name() for m in app.models] == [
        "Triton-tritonllm-default",
        "vLLM-vllm-default",
    ]


def test_llm_config_takes_id_checkpoint_deployment_and_the_vllm_python():
    model = vllm_model(
        vllm={
            "checkpoint": "ckpt",
            "python": "/opt/v/bin/python",
            "llm_config": {
                "engine_kwargs": {"dtype": "float32"},
                "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
            },
        }
    )
    config = llm_config(model, {"num_replicas": 2})
    assert config["model_loading_config"] == {
        "model_id": "v",
        "model_source": str(ROOT / "ckpt"),
    }
    assert config["deployment_config"] == {"num_replicas": 2}
    assert config["engine_kwargs"] == {"dtype": "float32"}
    assert config["runtime_env"] == {
        "env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "py_executable": "/opt/v/bin/python",
    }
    assert model.vllm.python_path() == Path("/opt/v/bin/python")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"vllm": None}, "needs a vllm section"),
        ({"engine": "triton"}, "needs engine: vllm"),
        ({"variants": ["a"]}, "without variants"),
        (
            {"vllm": {"checkpoint": "c", "llm_config": {"deployment_config": {}}}},
            "deployment_config comes from",
        ),
    ],
)
def test_bad_vllm_models_are_refused_with_the_field_named(fields, message):
    with pytest.raises(ValidationError, match=message):
        vllm_model(**fields)


@pytest.mark.parametrize(
    "sampling",
    [{}, {"top_k": 1}, {"top_k": 1, "temperature": 0.8}, {"temperature": 0.0}],
)
def test_greedy_requests_are_greedy_as_on_the_triton_path(sampling):
    # {"top_k": 1} is how the API sends a resolved greedy request (serve/api/common/sampling.py).
    kwargs = sampling_kwargs(GenerateParams(prompt="p", max_tokens=8, **sampling))
    assert kwargs == {
        "max_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "stop": [],
        "ignore_eos": False,
        "logprobs": None,
    }


def test_sampling_and_penalties_pass_through():
    params = GenerateParams(
        prompt="p",
        max_tokens=8,
        top_k=5,
        seed=3,
        min_tokens=2,
        stop=("x",),
        repetition_penalty=1.1,
        return_log_probs=True,
    )
    kwargs = sampling_kwargs(params)
    # Only top_k set: sampled at temperature 1 from the top 5 (as tritonllm's sampler).
    assert (kwargs["temperature"], kwargs["top_k"], kwargs["seed"]) == (1.0, 5, 3)
    assert (kwargs["min_tokens"], kwargs["stop"], kwargs["logprobs"]) == (2, ["x"], 0)
    assert kwargs["repetition_penalty"] == 1.1
    assert sampling_kwargs(GenerateParams(prompt="p", max_tokens=1, temperature=0.7))[
        "temperature"
    ] == pytest.approx(0.7)


def test_top_and_prompt_log_probs_and_logit_bias_become_vllms_own_fields():
    params = GenerateParams(
        prompt="p",
        max_tokens=8,
        return_log_probs=True,
        top_log_probs=3,
        prompt_log_probs=True,
        logit_bias=((7, 100.0), (9, -100.0)),
    )
    kwargs = sampling_kwargs(params)
    assert (kwargs["logprobs"], kwargs["prompt_logprobs"]) == (3, 3)
    assert kwargs["logit_bias"] == {7: 100.0, 9: -100.0}
    # The prompt's log probabilities without alternatives: the prompt's tokens' own.
    echo = GenerateParams(prompt="p", max_tokens=1, return_log_probs=True, prompt_log_probs=True)
    assert (sampling_kwargs(echo)["logprobs"], sampling_kwargs(echo)["prompt_logprobs"]) == (0, 0)
    # Alternatives without log probabilities asked for are none.
    assert (
        sampling_kwargs(GenerateParams(prompt="p", max_tokens=1, top_log_probs=2))["logprobs"]
        is None
    )


# -- vLLM's outputs, shaped as vLLM 0.29 makes them (vllm.outputs, vllm.logprobs) ----------


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = 0
    request_id: str = "r"
    prompt: str | None = "p"


def position(chosen: int, log_probs: dict[int, float], k: int) -> dict[int, Logprob]:
    """One position's dict as vLLM's sampler and ``append_logprobs_for_next_position``
    build it from the model's ``log_probs``: the chosen token first with its rank, then
    the top ``k`` with ranks 1..k (the chosen token once, if it is among them)."""
    ranked = sorted(log_probs, key=log_probs.__getitem__, reverse=True)
    ids = [chosen, *ranked[:k]]
    ranks = itertools.chain((ranked.index(chosen) + 1,), range(1, k + 1))
    return {t: Logprob(log_probs[t], r, f"<{t}>") for t, r in zip(ids, ranks, strict=True)}


# The model's log probabilities at each generated position (token id -> log probability).
MODEL = [
    {10: -0.5, 11: -1.0, 12: -2.0, 13: -3.0},
    {20: -0.2, 21: -2.5, 22: -2.6, 23: -4.0},
    {2: -0.01, 30: -5.0, 31: -6.0, 32: -7.0},  # 2: the end token
]
EOS = 2


def delta(step: int, chosen: int, k: int | None, text: str, finish=None, stop=None, **fields):
    logprobs = None if k is None else [position(chosen, MODEL[step], k)]
    cum = None if k is None else sum(MODEL[s][c] for s, c in enumerate(CHOSEN[: step + 1]))
    completion = CompletionOutput(0, text, [chosen], cum, logprobs, finish, stop_reason=stop)
    return RequestOutput([completion], [1, 5, 6], finished=finish is not None, **fields)


# Greedy would be 10, 20, 2: sampled, the first is 11 (inside the top 2, not the most
# likely), the second 23 (outside the top 2), then the end token.
CHOSEN = [11, 23, EOS]


def read(params: GenerateParams, k: int | None, **first) -> list[GenerationChunk]:
    reader = ChunkReader(params)
    outputs = [
        delta(0, 11, k, " a", num_cached_tokens=0, **first),
        delta(1, 23, k, " b", num_cached_tokens=0),
        delta(2, EOS, k, "", finish="stop", num_cached_tokens=0),
    ]
    return [reader(o) for o in outputs]


def test_chosen_tokens_and_exactly_k_alternatives_most_likely_first():
    params = GenerateParams(prompt="p", max_tokens=8, return_log_probs=True, top_log_probs=2)
    first, second, last = read(params, k=2)
    # Chosen inside the top 2 (listed first in vLLM's dict): alternatives in rank order.
    assert (first.token_ids, first.token_log_probs) == ((11,), (-1.0,))
    assert first.top_log_probs == (TopLogProbs((10, 11), (-0.5, -1.0)),)
    # Chosen outside the top 2 (vLLM's dict has 3 entries): the chosen token is kept as
    # the chosen one, not listed among the alternatives.
    assert (second.token_ids, second.token_log_probs) == ((23,), (-4.0,))
    assert second.top_log_probs == (TopLogProbs((20, 21), (-0.2, -2.5)),)
    # The end token (vLLM's last delta holds it): counted and logged (its log probability
    # and alternatives, in the cumulative sum), not among the ids (as on the Triton path:
    # TensorRT-LLM leaves it out of output_ids).
    assert (last.token_ids, last.token_log_probs, last.text) == ((), (-0.01,), "")
    assert last.top_log_probs == (TopLogProbs((2, 30), (-0.01, -5.0)),) and last.logs_end_token
    assert [c.num_output_tokens for c in (first, second, last)] == [1, 2, 3]
    assert [c.finish_reason for c in (first, second, last)] == [None, None, "stop"]
    assert last.cum_log_prob == pytest.approx(-1.0 - 4.0 - 0.01)
    assert {c.num_input_tokens for c in (first, second, last)} == {3}
    # Merged as the replica's coalesce merges them: the whole answer, position by position.
    whole = first.merged(second).merged(last)
    assert whole.token_ids == (11, 23) and len(whole.top_log_probs) == 3
    assert whole.logs_end_token and not first.merged(second).logs_end_token


def test_chosen_log_probs_only_when_no_alternatives_are_asked():
    params = GenerateParams(prompt="p", max_tokens=8, return_log_probs=True)
    chunks = read(params, k=0)
    assert [c.token_ids for c in chunks] == [(11,), (23,), ()]
    assert [c.token_log_probs for c in chunks] == [(-1.0,), (-4.0,), (-0.01,)]
    assert all(c.top_log_probs == () for c in chunks)


@pytest.mark.parametrize(
    ("finish", "stop"), [("stop", "b"), ("length", None)], ids=["stop string", "length"]
)
def test_an_answer_not_ended_by_the_end_token_keeps_its_last_token(finish, stop):
    reader = ChunkReader(GenerateParams(prompt="p", max_tokens=2, return_log_probs=True))
    first = reader(delta(0, 11, 0, " a"))
    last = reader(delta(1, 23, 0, " b", finish=finish, stop=stop))
    assert (first.token_ids, last.token_ids, last.token_log_probs) == ((11,), (23,), (-4.0,))
    assert (last.num_output_tokens, last.finish_reason) == (2, finish)
    assert last.cum_log_prob == pytest.approx(-5.0)


def test_without_log_probs_the_chunks_hold_text_ids_and_counts_the_end_token_included():
    chunks = read(GenerateParams(prompt="p", max_tokens=8), k=None)
    assert "".join(c.text for c in chunks) == " a b"
    assert [c.num_output_tokens for c in chunks] == [1, 2, 3]
    # The ids always (a lost replica's answer resumes from them), the end token's not.
    assert [c.token_ids for c in chunks] == [(11,), (23,), ()]
    assert all(c.token_log_probs == () and c.cum_log_prob is None for c in chunks)


# The model's log probabilities at the prompt's positions 1 and 2 (the prompt: 1, 5, 6).
PROMPT_MODEL = [{5: -1.5, 7: -0.5, 8: -1.0, 9: -3.0}, {6: -0.1, 7: -4.0, 8: -5.0}]


def prompt_log_probs(k: int) -> list[dict[int, Logprob] | None]:
    return [None, *(position(t, m, k) for t, m in zip((5, 6), PROMPT_MODEL, strict=True))]


@pytest.mark.parametrize("k", [0, 2])
def test_the_prompts_log_probs_come_on_the_first_chunk_none_for_its_first_token(k):
    params = GenerateParams(
        prompt="p", max_tokens=8, return_log_probs=True, top_log_probs=k, prompt_log_probs=True
    )
    # vLLM (DELTA) gives them on its first output, an empty list on the later ones.
    reader = ChunkReader(params)
    first = reader(delta(0, 11, k, " a", prompt_logprobs=prompt_log_probs(k)))
    later = reader(delta(1, 23, k, " b", prompt_logprobs=[]))
    top = (None, TopLogProbs((7, 8), (-0.5, -1.0)), TopLogProbs((6, 7), (-0.1, -4.0)))
    assert first.prompt == PromptLogProbs(
        token_ids=(1, 5, 6), log_probs=(None, -1.5, -0.1), top_log_probs=top if k else ()
    )
    assert later.prompt is None
    # Not asked for (vLLM returns none then either): none.
    plain = GenerateParams(prompt="p", max_tokens=8, return_log_probs=True)
    assert read(plain, 0)[0].prompt is None


def test_every_chunk_carries_the_prefix_caches_share_of_the_prompt():
    reader = ChunkReader(GenerateParams(prompt="p", max_tokens=8))
    chunks = [
        reader(delta(0, 10, None, " a", num_cached_tokens=128)),
        reader(delta(1, 20, None, " b", finish="length", num_cached_tokens=128)),
    ]
    assert [c.num_cached_tokens for c in chunks] == [128, 128]
    assert chunks[-1].finish_reason == "length"
    # vLLM's None (no prefill stats): none cached.
    assert reader(delta(2, EOS, None, "", num_cached_tokens=None)).num_cached_tokens == 0


# -- LoRA: a model's lora: section as Ray Serve LLM's lora_config --------------------------


def test_lora_becomes_ray_serve_llms_lora_config_and_vllms_engine_kwargs():
    given = {"engine_kwargs": {"dtype": "float32"}, "accelerator_config": {"kind": "cpu"}}
    config = lora_llm_config(given, "s3://bucket/adapters/", 16, 64)
    assert config["lora_config"] == {
        "dynamic_lora_loading_path": "s3://bucket/adapters",
        "max_num_adapters_per_replica": 16,
    }
    assert config["engine_kwargs"] == {
        "dtype": "float32",
        "enable_lora": True,
        "max_lora_rank": 64,
        "max_loras": 16,  # every adapter a replica caches may share a batch
    }
    assert config["accelerator_config"] == {"kind": "cpu"} and given["engine_kwargs"] == {
        "dtype": "float32"
    }  # the given dict is left as it was
    fewer = lora_llm_config({"engine_kwargs": {"max_loras": 4}}, "gs://b/a", 16, 64)
    assert fewer["engine_kwargs"]["max_loras"] == 4  # GPU memory: a smaller batch of adapters


@pytest.mark.parametrize(
    ("rank", "vllm_rank"), [(1, 1), (4, 8), (8, 8), (48, 64), (64, 64), (200, 256)]
)
def test_the_rank_bound_is_rounded_up_to_one_vllm_takes(rank, vllm_rank):
    assert vllm_max_lora_rank(rank) == vllm_rank
    config = lora_llm_config({}, "s3://b/a", 2, rank)
    assert config["engine_kwargs"]["max_lora_rank"] == vllm_rank


@pytest.mark.parametrize(
    ("given", "path", "message"),
    [
        ({}, "/data/adapters", "s3://, gs://, abfss://, azure:// URLs only"),
        ({}, "adapters", "serve a local adapter directory with engine: triton"),
        ({"lora_config": {"max_num_adapters_per_replica": 2}}, "s3://b/a", "not both"),
        ({"engine_kwargs": {"enable_lora": False}}, "s3://b/a", "engine_kwargs.enable_lora"),
        ({"engine_kwargs": {"max_lora_rank": 8}}, "s3://b/a", "max_lora_rank is 8"),
    ],
)
def test_lora_settings_ray_serve_llm_or_vllm_would_refuse_are_named(given, path, message):
    with pytest.raises(ValueError, match=message):
        lora_llm_config(given, path, 16, 64)


def test_a_vllm_models_lora_section_reaches_its_llm_config():
    lora = {"dynamic_lora_loading_path": "s3://bucket/adapters", "max_lora_rank": 16}
    model = vllm_model(
        lora=lora,
        vllm={"checkpoint": "ckpt", "llm_config": {"engine_kwargs": {"dtype": "float32"}}},
    )
    config = llm_config(model, {"num_replicas": 1})
    assert config["lora_config"] == {
        "dynamic_lora_loading_path": "s3://bucket/adapters",
        "max_num_adapters_per_replica": 16,  # serve/config.py's default, Ray Serve LLM's too
    }
    assert config["engine_kwargs"] == {
        "dtype": "float32",
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 16,
    }
    # Clients name an adapter `<id>:<adapter>`, Ray Serve LLM's own form (its base id
    # before the colon, the adapter's folder under the path after it).
    assert model.adapter_id("sql") == "v:sql"
    assert "lora_config" not in llm_config(vllm_model(), {})
    local = vllm_model(lora={"dynamic_lora_loading_path": "adapters"})
    with pytest.raises(ValueError, match="engine: triton"):
        llm_config(local, {})
