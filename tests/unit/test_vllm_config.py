"""The vLLM engine's config, its LLMConfig and the sampling translation (no vLLM here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from serve.config import ROOT, AppConfig, ModelConfig
from serve.generation import GenerateParams
from serve.vllm_deployment import llm_config
from serve.vllm_params import sampling_kwargs


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
    # {"top_k": 1} is how the API sends a resolved greedy request (serve/api/sampling.py).
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
