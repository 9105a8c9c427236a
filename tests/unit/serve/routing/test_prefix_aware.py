"""routing: prefix_aware: the Serve options it gives and what Ray's router reads."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from ray.llm._internal.serve.routing_policies.prefix_aware import prefix_aware_router
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest
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


class LocalTree:
    """Ray's prefix tree in this process, called as its actor is (``.method.remote()``)."""

    def __init__(self):
        self.tree = PrefixTree()

    def __getattr__(self, name: str):
        return SimpleNamespace(remote=getattr(self.tree, name))


class Replica:
    """What the router reads of a running replica: an idle one holding ``variants``."""

    def __init__(self, name: str, variants: set[str]):
        self.replica_id = ReplicaID(name, DeploymentID(name="Triton-pool", app_name="llm"))
        self.multiplexed_model_ids = variants
        self.max_ongoing_requests, self.node_id, self.availability_zone = 32, "n", None

    async def get_queue_len(self, deadline_s: float) -> int:
        return 0


def request(prompt: str, variant: str) -> PendingRequest:
    metadata = RequestMetadata("r", "r", multiplexed_model_id=variant)
    return PendingRequest(
        args=[GenerateParams(prompt=prompt, max_tokens=4)], kwargs={}, metadata=metadata
    )


@pytest.mark.parametrize("seen", [False, True], ids=["new-prompt", "prompt-seen-elsewhere"])
def test_a_variants_request_goes_only_to_replicas_holding_it(monkeypatch, seen):
    """Ray's router alone chose among the replicas holding the fewest variants, and its
    fallback for a new prompt among all replicas: either makes a replica load again."""
    monkeypatch.setattr(prefix_aware_router, "ray", SimpleNamespace(get=lambda value: value))
    holder, other = Replica("holder", {"ft-a"}), Replica("other", set())

    async def chosen() -> set[str]:
        router_class = import_attr(PREFIX_AWARE_ROUTER)
        router = router_class(
            deployment_id=holder.replica_id.deployment_id,
            handle_source=DeploymentHandleSource.UNKNOWN,
        )
        router.initialize_state(imbalanced_threshold=8, tree_actor=LocalTree())
        router.update_replicas([holder, other])
        if seen:  # the same prompt was served by the other replica for another variant
            router._tree_actor.tree.insert(
                "Where is the cat?", other.replica_id.to_full_id_str(), 0
            )
        names = set()
        for _ in range(20):
            (replicas,) = await router.choose_replicas(
                router._replicas_list, request("Where is the cat?", "ft-a")
            )
            names |= {r.replica_id.unique_id for r in replicas}
        return names

    assert asyncio.run(chosen()) == {"holder"}


def test_a_prompt_given_as_token_ids_alone_is_routed(monkeypatch):
    """Ray's prefix match divides by the prompt text's length: a request with none (a
    client's token ids) raised in the router and was never routed."""
    monkeypatch.setattr(prefix_aware_router, "ray", SimpleNamespace(get=lambda value: value))
    replicas = [Replica("a", set()), Replica("b", set())]

    async def chosen() -> set[str]:
        router_class = import_attr(PREFIX_AWARE_ROUTER)
        router = router_class(
            deployment_id=replicas[0].replica_id.deployment_id,
            handle_source=DeploymentHandleSource.UNKNOWN,
        )
        router.initialize_state(imbalanced_threshold=8, tree_actor=LocalTree())
        router.update_replicas(replicas)
        params = GenerateParams(prompt="", prompt_token_ids=(1, 5, 6), max_tokens=4)
        pending = PendingRequest(args=[params], kwargs={}, metadata=RequestMetadata("r", "r"))
        (picked,) = await router.choose_replicas(router._replicas_list, pending)
        return {r.replica_id.unique_id for r in picked}

    names = asyncio.run(chosen())
    assert names and names <= {"a", "b"}
