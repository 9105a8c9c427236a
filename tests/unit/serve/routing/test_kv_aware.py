"""routing: kv_aware: its Serve options, what a replica advertises, and the router's
index (Dynamo's own) following publishing engines: the replica holding a prompt's
prefix is chosen, an adapter's blocks count for its own prompts only, a replica that
leaves takes its blocks along."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from ray import cloudpickle
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.request_router.request_router import RequestRouter
from ray.serve._private.utils import import_attr

import serve
from bench.common import set_engine_parameter
from serve.app import KV_AWARE_ROUTER, replica_options
from serve.config import AppConfig, ModelConfig
from serve.engines.triton import repository
from serve.engines.triton.kv_events import KvEventEndpoints
from serve.generation import GenerateParams
from serve.routing import kv_index
from tests.unit.tritonllm.engine.test_kv_events import LORA_ROOT, _eventually, free_ports, saved
from tests.unit.tritonllm.engine.test_prefix_cache import BLOCK, pool
from tritonllm.contract import KV_EVENTS_ENDPOINTS_ENV as ENDPOINTS_ENV
from tritonllm.engine.kv_events import KVEventPublisher


def test_kv_aware_routing_is_its_router_balancing_past_one_engine_batch(built_repository):
    model = ModelConfig(
        id="m",
        routing="kv_aware",
        triton={"model_repository": str(built_repository)},
        deployment={"num_replicas": 2},
    )
    config = replica_options(model)["request_router_config"]
    assert config.request_router_class == KV_AWARE_ROUTER
    assert issubclass(import_attr(KV_AWARE_ROUTER), RequestRouter)
    assert config.request_router_kwargs == {
        "model": "m",
        "repository_dir": str(built_repository),
        "imbalanced_threshold": 8,  # the built batch size
    }
    assert config.request_routing_stats_period_s == 2


def test_the_router_class_travels_to_serves_controller_by_value():
    """Serve pickles the class with the globals its methods use (a Prometheus metric's
    lock cannot travel: the router imports kv_index where it runs)."""
    cloudpickle.register_pickle_by_value(serve)
    try:
        cloudpickle.dumps(import_attr(KV_AWARE_ROUTER))
    finally:
        cloudpickle.unregister_pickle_by_value(serve)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"id": "e", "task": "embed", "routing": "kv_aware"}, "task generate only"),
        ({"id": "p", "variants": ["a", "b"], "routing": "kv_aware"}, "pool of variants"),
        (
            {"id": "v", "engine": "vllm", "vllm": {"checkpoint": "/m"}, "routing": "kv_aware"},
            "vllm routes with prefix_aware",
        ),
    ],
)
def test_kv_aware_routing_is_for_one_triton_engine_per_replica(model, message):
    with pytest.raises(ValidationError, match=message):
        AppConfig.model_validate({"models": [{"id": "g"}, model]})


def test_the_torch_engine_with_a_prefix_cache_publishes_events(built_repository, tmp_path):
    assert repository.kv_event_block_size(built_repository) == 16
    off = tmp_path / "repository"
    (off / "tensorrt_llm").mkdir(parents=True)
    shutil.copy(built_repository / "tensorrt_llm" / "config.pbtxt", off / "tensorrt_llm")
    set_engine_parameter(off, "prefix_cache_mb", 0)
    assert repository.kv_event_block_size(off) is None  # the cache off: nothing to tell


def test_a_replica_advertises_where_its_engine_publishes(built_repository, monkeypatch):
    monkeypatch.delenv(ENDPOINTS_ENV, raising=False)
    model = ModelConfig(
        id="m", routing="kv_aware", triton={"model_repository": str(built_repository)}
    )
    endpoints = KvEventEndpoints.open(model)
    pub, replay = os.environ[ENDPOINTS_ENV].split(",")
    assert pub == f"tcp://*:{endpoints.port}" and replay == f"tcp://*:{endpoints.replay_port}"
    monkeypatch.setattr("ray.util.get_node_ip_address", lambda: "10.0.0.7")
    stats = endpoints.routing_stats({"french": 1234})[kv_index.KV_EVENT_METADATA]
    assert stats == {
        "endpoint": f"tcp://10.0.0.7:{endpoints.port}",
        "replay_endpoint": f"tcp://10.0.0.7:{endpoints.replay_port}",
        "block_size": 16,
        "max_num_batched_tokens": 8192,
        "adapters": {"french": "1234"},
    }


def replica(name: str, pub: int | None = None, replay: int | None = None, adapters=None):
    """A RunningReplica as the router sees it: its id and its routing stats."""
    stats = {}
    if pub is not None:
        stats[kv_index.KV_EVENT_METADATA] = {
            "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "block_size": BLOCK,
            "max_num_batched_tokens": 256,
            "adapters": adapters or {},
        }
    return SimpleNamespace(
        replica_id=ReplicaID(name, DeploymentID("m", "app")), routing_stats=stats
    )


def test_the_router_chooses_the_replica_holding_the_prefix_and_forgets_one_gone():
    """Dynamo's index over two publishing pools: the replica holding the prompt; for an
    adapter's prompt, the one holding the adapter's blocks."""
    pytest.importorskip("dynamo.llm")
    asyncio.run(_routes_by_what_engines_hold())


async def _routes_by_what_engines_hold():
    loop = asyncio.get_running_loop()
    engines, replicas = [], []
    for name in ("a", "b"):
        pub, replay = free_ports(2)
        publisher = KVEventPublisher(f"tcp://*:{pub}", f"tcp://*:{replay}", BLOCK)
        prefix, cache = pool(8)
        prefix.events = publisher
        engines.append((prefix, cache, publisher))
        replicas.append(replica(name, pub, replay, adapters={"french": str(LORA_ROOT[2])}))
    replicas.append(replica("c"))  # advertises nothing (yet): not followed
    scorer = kv_index.KvScorer("m", "unused: the requests carry token ids")
    try:
        scorer.index.follow(replicas, loop)
        await asyncio.sleep(0.5)  # subscribed (a later joiner learns at the next batch)
        prompt = tuple(range(1, 13))
        saved(*engines[1][:2], list(prompt))  # b holds the prompt's 3 blocks
        saved(*engines[0][:2], list(prompt), root=LORA_ROOT)  # a holds them for "french"
        service = scorer.index._service
        await _eventually(service, list(prompt), None, lambda s: s.get(_worker("b")) == 3)
        await _eventually(service, list(prompt), "12345", lambda s: s.get(_worker("a")) == 3)

        def params(**fields):
            return GenerateParams(prompt="", max_tokens=4, prompt_token_ids=prompt, **fields)

        assert await scorer.choose(replicas, params()) == [replicas[1]]
        assert await scorer.choose(replicas, params(adapter="french")) == [replicas[0]]
        assert await scorer.choose(replicas, params(adapter="other")) == []  # not named yet
        resumed = GenerateParams(prompt="", max_tokens=4, prompt_token_ids=(*prompt, 99, 98))
        assert await scorer.choose(replicas, resumed) == [replicas[1]]  # prompt + answer
        assert await scorer.choose([replicas[2]], params()) == []  # c is not followed
        # New prefixes (no engine holds a tenth) go where the fewest new tokens went.
        placed = []
        for first in (200, 300, 400, 500):
            new = GenerateParams(
                prompt="", max_tokens=4, prompt_token_ids=tuple(range(first, first + 12))
            )
            (chosen,) = await scorer.choose(replicas, new)
            placed.append(chosen.replica_id.unique_id)
        assert sorted(placed) == ["a", "a", "b", "b"]

        scorer.index.follow([replicas[0], replicas[2]], loop)  # b left, its blocks with it
        await asyncio.sleep(0.2)
        assert _worker("b") not in await scorer.index.overlaps(list(prompt), None)
        assert await scorer.choose(replicas[:2], params()) == [replicas[0]]  # the only one left
    finally:
        for _, _, publisher in engines:
            publisher.close()
        await scorer.index._service.shutdown_async()


def _worker(name: str) -> int:
    return kv_index.worker_id(ReplicaID(name, DeploymentID("m", "app")))


def test_text_prompts_are_tokenized_as_the_preprocessing_does(built_repository, tokenizer):
    prompts = kv_index.PromptTokens(str(built_repository))
    text = "The robot writes a long letter to the old town."
    params = GenerateParams(prompt=text, max_tokens=1)
    assert asyncio.run(prompts.of(params)) == tokenizer.encode(text)


def test_without_dynamos_indexer_the_model_routes_by_load(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "dynamo.llm", None)  # its import fails
    scorer = kv_index.KvScorer("m", "unused")
    assert not scorer.index.available
    assert "routes by load" in caplog.text and "ai-dynamo-runtime" in caplog.text
    params = GenerateParams(prompt="", max_tokens=1, prompt_token_ids=(1, 2, 3))
    assert asyncio.run(scorer.choose([replica("a"), replica("b")], params)) == []


def test_an_index_that_cannot_answer_leaves_the_request_to_load(monkeypatch, caplog):
    """Dynamo refusing (no replica subscribed yet, say) routes the request by load and
    logs why once."""
    pytest.importorskip("dynamo.llm")

    async def refuse(*args):
        raise RuntimeError("no schedulable workers are available")

    async def route_twice():
        scorer = kv_index.KvScorer("m", "unused")
        scorer.index.follow([replica("a", 1, 2)], asyncio.get_running_loop())
        monkeypatch.setattr(scorer.index, "overlaps", refuse)
        params = GenerateParams(prompt="", max_tokens=1, prompt_token_ids=(1, 2, 3))
        try:
            return [await scorer.choose([replica("a", 1, 2)], params) for _ in range(2)]
        finally:
            await scorer.index._service.shutdown_async()

    assert asyncio.run(route_twice()) == [[], []]
    assert caplog.text.count("no schedulable workers") == 1
