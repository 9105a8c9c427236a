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

# serve/deployments/vllm_server.py, imported only in the vLLM environment.
VLLM_SERVER = "serve.deployments.vllm_server.VLLMServer"
OPTIONS_TIMEOUT_S = 300.0  # a first start of the vLLM environment's worker imports vLLM


def llm_config(model: ModelConfig, deployment: dict[str, Any]) -> dict[str, Any]:
    """Ray Serve LLM's ``LLMConfig`` of ``model`` as a dict: the passed-through fields,
    the model's id and checkpoint, ``deployment`` (Serve options) and the vLLM
    environment's interpreter in the runtime_env."""
    vllm = model.vllm
    given = dict(vllm.llm_config)
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
        .bind(config, model.stream_interval_ms)
    )


def _llm_server_options(config: dict[str, Any]) -> dict[str, Any]:
    """Runs in the vLLM environment (a Ray task)."""
    from ray.serve.llm import LLMConfig
    from ray.serve.llm.deployment import LLMServer

    return LLMServer.get_deployment_options(LLMConfig.model_validate(config))


def _imported_in_the_replica():
    raise AssertionError(f"replaced by {VLLM_SERVER}")
