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
from serve.app import KV_AWARE_ROUTER, PREFIX_AWARE_ROUTER, replica_options
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


def test_an_engine_without_events_routes_as_prefix_aware(built_repository, tmp_path, caplog):
    assert repository.kv_event_block_size(built_repository) == 16
    off = tmp_path / "repository"
    shutil.copytree(built_repository, off, ignore=shutil.ignore_patterns("hf_model"))
    set_engine_parameter(off, "prefix_cache_mb", 0)
    assert repository.kv_event_block_size(off) is None  # the cache off: nothing to tell
    model = ModelConfig(id="m", routing="kv_aware", triton={"model_repository": str(off)})
    config = replica_options(model)["request_router_config"]
    assert config.request_router_class == PREFIX_AWARE_ROUTER
    assert "publishes no KV cache events" in caplog.text and "as prefix_aware" in caplog.text
    assert KvEventEndpoints.open(model) is None  # its replica opens no ports


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


def test_a_prompt_whose_prefix_was_just_routed_follows_it_before_any_event():
    """A tenant's second conversation arriving while its first still waits for its
    prefill (nothing published yet) goes where the first went, not where new prefixes
    go; a retried choice is counted once; after the record's time, the index alone."""
    pytest.importorskip("dynamo.llm")
    asyncio.run(_follows_what_was_just_routed())


async def _follows_what_was_just_routed():
    loop = asyncio.get_running_loop()
    publishers, replicas = [], []
    for name in ("a", "b"):
        pub, replay = free_ports(2)
        publishers.append(KVEventPublisher(f"tcp://*:{pub}", f"tcp://*:{replay}", BLOCK))
        replicas.append(replica(name, pub, replay))
    scorer = kv_index.KvScorer("m", "unused: the requests carry token ids")
    routed = kv_index.ROUTED.labels("m", "placed")

    def conversation(tenant: int, turn: int) -> GenerateParams:
        system = tuple(range(tenant * 100, tenant * 100 + 3 * BLOCK))  # 3 blocks
        return GenerateParams(prompt="", max_tokens=4, prompt_token_ids=(*system, turn, turn))

    try:
        scorer.index.follow(replicas, loop)
        await asyncio.sleep(0.3)
        (first,) = await scorer.choose(replicas, conversation(1, 1), "r1")
        scorer.placed_on("r1", first.replica_id)
        other = replicas[1 - replicas.index(first)]
        before = routed._value.get()
        timed = kv_index.CHOICE_SECONDS.labels("m")._sum.get()
        assert await scorer.choose(replicas, conversation(1, 2), "r2") == [first]
        assert kv_index.CHOICE_SECONDS.labels("m")._sum.get() > timed  # its time observed
        assert await scorer.choose(replicas, conversation(1, 2), "r2") == [first]  # retried
        assert routed._value.get() == before + 1
        scorer.placed_on("r2", first.replica_id)
        # A new tenant goes to the replica sent the fewest new prefixes: the other one.
        assert await scorer.choose(replicas, conversation(2, 1), "r3") == [other]
        scorer.placed.__init__(ttl_s=0)  # the record's time past: nothing placed lately
        new = kv_index.ROUTED.labels("m", "no_overlap")
        before = new._value.get()
        await scorer.choose(replicas, conversation(1, 3), "r4")
        assert new._value.get() == before + 1  # a new prefix again, to the index
    finally:
        for publisher in publishers:
            publisher.close()
        await scorer.index._service.shutdown_async()


def test_placed_prefixes_count_blocks_from_the_first_per_replica_and_age_out():
    keys = kv_index.block_keys(list(range(40)), 16, None)
    assert len(keys) == 2  # full blocks only
    assert kv_index.block_keys(list(range(32)), 16, "7") != keys  # an adapter's own
    assert kv_index.block_keys([*range(16), 99], 16, None) == keys[:1]  # the first shared
    placed = kv_index.PlacedPrefixes(max_blocks=3)
    placed.add(keys, worker=1)
    placed.add(keys[:1], worker=2)
    assert placed.held(keys, [1, 2, 3]) == {1: 2, 2: 1}
    second_alone = kv_index.block_keys(list(range(16, 32)), 16, None)
    assert placed.held(second_alone, [1]) == {}  # a key stands for its whole prefix
    placed.add(kv_index.block_keys(list(range(100, 132)), 16, None), worker=2)
    assert placed.held(keys, [1, 2]) == {2: 1}  # the oldest, 1's, gone past max_blocks


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
