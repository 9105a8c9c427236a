"""A vLLM model's Serve deployment: Ray Serve LLM's ``LLMServer`` in the vLLM environment.

The application is built in the project's environment, where ``ray.serve.llm`` does
not import (it needs vLLM, whose numpy and protobuf floors conflict with Triton's
client). So the deployment is named by import path (Serve imports it in the replica,
whose ``runtime_env`` ``py_executable`` is the vLLM environment's Python), its
argument is a plain ``LLMConfig`` dict, and its options are Ray Serve LLM's own
``LLMServer.get_deployment_options`` (placement bundles, runtime_env), computed by one
Ray task in the vLLM environment rather than re-implemented here.
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve

from serve.config import ModelConfig

# serve/engines/vllm/server.py, imported only in the vLLM environment.
VLLM_SERVER = "serve.engines.vllm.server.VLLMServer"
OPTIONS_TIMEOUT_S = 300.0  # a first start of the vLLM environment's worker imports vLLM


def llm_config(model: ModelConfig, deployment: dict[str, Any]) -> dict[str, Any]:
    """Ray Serve LLM's ``LLMConfig`` of ``model`` as a dict: the passed-through fields,
    the model's ``lora:`` section (:func:`lora_llm_config`), the model's id and
    checkpoint, ``deployment`` (Serve options) and the vLLM environment's interpreter
    in the runtime_env."""
    vllm = model.vllm
    given = dict(vllm.llm_config)
    if model.lora is not None:
        lora = model.lora
        given = lora_llm_config(
            given,
            lora.dynamic_lora_loading_path,
            lora.max_num_adapters_per_replica,
            lora.max_lora_rank,
        )
    runtime_env = dict(given.pop("runtime_env", None) or {})
    runtime_env["py_executable"] = str(vllm.python_path())
    return given | {
        "model_loading_config": {
            "model_id": model.id,
            "model_source": str(vllm.checkpoint_path()),
        },
        "deployment_config": deployment,
        "runtime_env": runtime_env,
    }


# Where Ray Serve LLM's LoraConfig downloads adapters from (its validator refuses others).
REMOTE_SCHEMES = ("s3://", "gs://", "abfss://", "azure://")
# The max_lora_rank values vLLM takes (vllm/config/lora.py MaxLoRARanks, 0.29).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(max_lora_rank: int) -> int:
    """The least rank vLLM takes that holds ``max_lora_rank`` (a bound, not a size:
    adapters above ``max_lora_rank`` are refused before they reach vLLM)."""
    for rank in VLLM_MAX_LORA_RANKS:
        if rank >= max_lora_rank:
            return rank
    raise ValueError(f"max_lora_rank {max_lora_rank} is above vLLM's largest, 512")


def lora_llm_config(
    given: dict[str, Any],
    dynamic_lora_loading_path: str,
    max_num_adapters_per_replica: int,
    max_lora_rank: int,
) -> dict[str, Any]:
    """``given`` (an ``LLMConfig`` dict) with a model's ``lora:`` section on Ray Serve
    LLM's terms: its ``lora_config`` (adapters found under the path at request time,
    ``<model id>:<adapter>`` naming the adapter's folder, as many cached per replica)
    and vLLM's ``engine_kwargs`` (``enable_lora``, ``max_lora_rank`` rounded up to a
    rank vLLM takes, and ``max_loras``: every cached adapter may run in one batch unless
    ``engine_kwargs`` says fewer)."""
    if not dynamic_lora_loading_path.startswith(REMOTE_SCHEMES):
        raise ValueError(
            f"lora.dynamic_lora_loading_path {dynamic_lora_loading_path!r}: Ray Serve LLM "
            f"loads vLLM's adapters from {', '.join(REMOTE_SCHEMES)} URLs only (its "
            "LoraConfig); serve a local adapter directory with engine: triton"
        )
    if given.get("lora_config") is not None:
        raise ValueError(
            "set lora: or vllm.llm_config.lora_config, not both (lora: fills the latter)"
        )
    engine_kwargs = dict(given.get("engine_kwargs") or {})
    rank = vllm_max_lora_rank(max_lora_rank)
    for key, value in (("enable_lora", True), ("max_lora_rank", rank)):
        if engine_kwargs.setdefault(key, value) != value:
            raise ValueError(
                f"vllm.llm_config.engine_kwargs.{key} is {engine_kwargs[key]!r}, lora: "
                f"makes it {value!r}: leave it out of engine_kwargs"
            )
    engine_kwargs.setdefault("max_loras", max_num_adapters_per_replica)
    return given | {
        "lora_config": {
            "dynamic_lora_loading_path": dynamic_lora_loading_path.rstrip("/"),
            "max_num_adapters_per_replica": max_num_adapters_per_replica,
        },
        "engine_kwargs": engine_kwargs,
    }


def build(model: ModelConfig, deployment: dict[str, Any]):
    """The bound deployment of ``model`` (``deployment``: its Serve options as
    :func:`serve.app.replica_options` makes them for a Triton model)."""
    python = model.vllm.python_path()
    if not python.exists():
        raise FileNotFoundError(
            f"model {model.id}: no vLLM environment at {python}: run `make vllm-env` "
            "(or set vllm.python to one)"
        )
    name = deployment.pop("name")
    config = llm_config(model, deployment)
    options = ray.get(
        ray.remote(num_cpus=0)(_llm_server_options)
        .options(runtime_env={"py_executable": str(python)})
        .remote(config),
        timeout=OPTIONS_TIMEOUT_S,
    )
    # A placeholder callable first: serve.deployment takes no import path, but
    # Deployment.options does (Serve imports it in the replica's own environment).
    return (
        serve.deployment(_imported_in_the_replica)
        .options(func_or_class=VLLM_SERVER, name=name, **options)
        .bind(config, model.stream_interval_ms, model.stream_chunks_per_s)
    )


def _llm_server_options(config: dict[str, Any]) -> dict[str, Any]:
    """Runs in the vLLM environment (a Ray task)."""
    from ray.serve.llm import LLMConfig
    from ray.serve.llm.deployment import LLMServer

    return LLMServer.get_deployment_options(LLMConfig.model_validate(config))


def _imported_in_the_replica():
    raise AssertionError(f"replaced by {VLLM_SERVER}")
