"""routing: prefix_aware: the Serve options it gives and what Ray's router reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from ray.serve._private.request_router.request_router import RequestRouter
from ray.serve._private.utils import import_attr

from serve.app import PREFIX_AWARE_ROUTER, replica_options
from serve.config import AppConfig, ModelConfig
from serve.generation import GenerateParams


def test_prefix_aware_routing_is_rays_router_balancing_past_one_engine_batch(built_repository):
    model = ModelConfig(id="m", routing="prefix_aware", deployment={"num_replicas": 2})
    config = replica_options(model)["request_router_config"]
    assert config.request_router_class == PREFIX_AWARE_ROUTER
    assert config.request_router_kwargs["imbalanced_threshold"] == 8  # the built batch size
    assert config.request_router_kwargs["do_eviction"]
    assert "request_router_config" not in replica_options(ModelConfig(id="m"))


def test_rays_router_reads_the_prompt_of_generate_params():
    router_class = import_attr(PREFIX_AWARE_ROUTER)
    assert issubclass(router_class, RequestRouter)
    router = object.__new__(router_class)  # the method reads the request only
    params = GenerateParams(prompt="You are a robot. Where is the cat?", max_tokens=4)
    request = SimpleNamespace(args=[params], kwargs={})
    assert router._extract_text_from_request(request) == params.prompt


def test_prefix_aware_routing_is_for_generate_models():
    with pytest.raises(ValidationError, match="task generate only"):
        AppConfig.model_validate(
            {"models": [{"id": "g"}, {"id": "e", "task": "embed", "routing": "prefix_aware"}]}
        )
