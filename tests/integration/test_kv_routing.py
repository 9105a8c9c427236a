"""routing: kv_aware on a real cluster: two models of two Triton replicas each, every
engine publishing its KV cache events, each model's router following its replicas
with Dynamo's indexer.

One application for the module: ``kv-big`` (the default model, with LoRA adapters) and
``kv-small`` (its prefix cache 8 blocks: a few prompts evict). Which replica served a
request is read from the replicas' own prefix-cache counters (their Tritons' metrics),
what the router decided from its counters in the app's ``/metrics``."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from bench.common import set_engine_parameter
from serve.adapters import read_adapter
from tests.integration.cluster import app_config, child_pids, process_name, triton_http_url
from tests.integration.test_prefix_routing import (
    OPENINGS,
    prefix_counters,
    served_by,
    settled_counters,
)
from tests.lora_adapters import SPECS, make_adapter
from tritonllm.contract import KV_EVENTS_ENDPOINTS_ENV as ENDPOINTS_ENV
from tritonllm.engine.kv_events import END_OF_REPLAY

pytestmark = pytest.mark.integration

BIG, SMALL = "kv-big", "kv-small"
ADAPTER = "adapter-0"
TWO = {"autoscaling_config": None, "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}}
SMALL_CACHE_BLOCKS = 8  # the default model keeps 4 KiB per token: 16-token blocks of 64 KiB


@pytest.fixture(scope="module")
def adapters_dir(checkpoint_dir, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("kv-adapters")
    make_adapter(checkpoint_dir, SPECS[0], 0, directory / ADAPTER, 1)
    return directory


@pytest.fixture(scope="module")
def kv_app(cluster, built_repository, adapters_dir, tmp_path_factory):
    small = tmp_path_factory.mktemp("kv-small") / "repository"
    shutil.copytree(built_repository, small)
    set_engine_parameter(small, "prefix_cache_mb", SMALL_CACHE_BLOCKS * 16 * 4096 / 2**20)
    models = [
        {
            "id": BIG,
            "triton": {"model_repository": str(built_repository)},
            "lora": {"dynamic_lora_loading_path": str(adapters_dir), "max_lora_rank": 16},
            "routing": "kv_aware",
            "deployment": TWO,
        },
        {
            "id": SMALL,
            "triton": {"model_repository": str(small)},
            "routing": "kv_aware",
            "deployment": TWO,
        },
    ]
    cluster.deploy(app_config(models))
    cluster.wait_running(settled=True)
    for model in (BIG, SMALL):  # each router (made on its first request) follows both
        complete(cluster.url, model, "Hello")
        wait_for_router(cluster.url, lambda m, model=model: m.get(("workers", model, "")) == 2)
    return cluster


def replicas_of(cluster, model: str) -> list[dict]:
    replicas = cluster.running_replicas("llm", f"Triton-{model}")
    assert len(replicas) == 2, replicas
    return replicas


def router_metrics(url: str) -> dict[tuple[str, str, str], float]:
    """The kv_aware router's figures in the app's /metrics: (figure, model, how)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            match = re.fullmatch(r"tritonllm_kv_router_(\w+?)(_total)?", sample.name)
            if match:
                key = (match.group(1), sample.labels.get("model", ""), sample.labels.get("how", ""))
                found[key] = found.get(key, 0.0) + sample.value
    return found


def wait_for_router(url: str, check, timeout_s: float = 60) -> dict:
    """The router's figures once ``check`` holds (processes push theirs every few s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = router_metrics(url)
        if check(metrics):
            return metrics
        assert time.monotonic() < deadline, metrics
        time.sleep(0.5)


def routed(url: str, model: str, before: dict, how: str):
    """A check: one more request of ``model`` was routed ``how`` since ``before``."""
    key = ("requests", model, how)
    return lambda m: m.get(key, 0) > before.get(key, 0)


def complete(url: str, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_each_conversation_goes_to_the_replica_whose_engine_holds_it(kv_app):
    urls = [triton_http_url(r, port="metrics") for r in replicas_of(kv_app, BIG)]
    holders = {}
    for conversation, opening in enumerate(OPENINGS):
        prompt = opening
        for turn in range(3):
            prompt += f" Question {turn}: where did they go next?"
            before = [prefix_counters(u) for u in urls]
            complete(kv_app.url, BIG, prompt)
            holders.setdefault(conversation, set()).add(served_by(urls, before))
    assert all(len(r) == 1 for r in holders.values()), holders
    metrics = wait_for_router(
        kv_app.url, lambda m: m.get(("requests", BIG, "overlap"), 0) >= 2 * len(OPENINGS)
    )
    # Each later turn found its earlier turns' blocks: at least one 16-token block each.
    assert metrics[("overlap_tokens", BIG, "")] >= 2 * len(OPENINGS) * 16
    assert metrics[("prompt_tokens", BIG, "")] > metrics[("overlap_tokens", BIG, "")]


def test_two_models_route_by_their_own_index(kv_app):
    """A prompt kv-big's engines hold is new to kv-small's index: its first request there
    is routed by load, its second to the replica that served the first."""
    prompt = "Two models, two indexes: " + OPENINGS[1] * 2
    complete(kv_app.url, BIG, prompt)
    complete(kv_app.url, BIG, prompt)
    before = router_metrics(kv_app.url)
    urls = [triton_http_url(r, port="metrics") for r in replicas_of(kv_app, SMALL)]
    counters = settled_counters(urls)
    complete(kv_app.url, SMALL, prompt)
    first = served_by(urls, counters)
    wait_for_router(kv_app.url, routed(kv_app.url, SMALL, before, "no_overlap"))
    before, counters = router_metrics(kv_app.url), settled_counters(urls)
    complete(kv_app.url, SMALL, prompt)
    assert served_by(urls, counters) == first
    wait_for_router(kv_app.url, routed(kv_app.url, SMALL, before, "overlap"))


def kv_endpoints(replica: dict) -> tuple[str, str]:
    """The replica's engine's PUB and replay endpoints (its Triton's environment)."""
    for pid in child_pids(replica["pid"]):
        if process_name(pid) == "tritonserver":
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            (value,) = [v for v in environ if v.startswith(ENDPOINTS_ENV.encode() + b"=")]
            pub, replay = value.split(b"=", 1)[1].decode().split(",")
            return pub.replace("*", "127.0.0.1"), replay.replace("*", "127.0.0.1")
    raise AssertionError(f"replica {replica['replica_id']} has no Triton child")


def replayed_events(replay_endpoint: str) -> list[dict]:
    """Every event the engine published since it started, from its replay socket."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    events = []
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        expected = 0
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                return events
            assert int.from_bytes(seq, "big") == expected  # no batch lost from the buffer
            expected += 1
            events.extend(msgspec.msgpack.decode(payload)[1])
    finally:
        context.destroy(linger=0)


def live_blocks(events: list[dict]) -> dict[int, list[int]]:
    """Block hash -> its tokens, of the blocks stored and not since removed."""
    live: dict[int, list[int]] = {}
    for event in events:
        if event["type"] == "AllBlocksCleared":
            live.clear()
        elif event["type"] == "BlockStored":
            size = event["block_size"]
            for i, digest in enumerate(event["block_hashes"]):
                live[digest] = event["token_ids"][i * size : (i + 1) * size]
        else:
            for digest in event["block_hashes"]:
                live.pop(digest, None)
    return live


def test_a_replicas_events_equal_its_engines_cache_through_evictions(kv_app, tokenizer):
    """kv-small's engines hold 8 blocks: after prompts of 24 blocks the events of each
    replica say it holds exactly 8, the last prompt's blocks among them, and the
    evicted ones were removed."""
    prompts = [f"{i}: " + " ".join(OPENINGS) for i in range(4)]  # about 6 blocks each
    for prompt in prompts:
        complete(kv_app.url, SMALL, prompt)
        complete(kv_app.url, SMALL, prompt)  # once more: both replicas may hold it
    last_blocks = _blocks(tokenizer.encode(prompts[-1]))
    holding_last = 0
    for replica in replicas_of(kv_app, SMALL):
        events = replayed_events(kv_endpoints(replica)[1])
        assert events[0] == {"type": "AllBlocksCleared"}
        live = live_blocks(events)
        stored = sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")
        removed = sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockRemoved")
        assert len(live) == stored - removed <= SMALL_CACHE_BLOCKS
        if stored > SMALL_CACHE_BLOCKS:
            assert len(live) == SMALL_CACHE_BLOCKS and removed > 0
        holding_last += all(block in live.values() for block in last_blocks[:-1])
    assert holding_last >= 1


def _blocks(tokens: list[int], size: int = 16) -> list[list[int]]:
    return [tokens[i : i + size] for i in range(0, len(tokens) - size + 1, size)]


def test_an_adapters_blocks_are_its_own_named_by_its_task_id(kv_app, adapters_dir, tokenizer):
    """The router scores an adapter's prompt by this name (serve/routing/kv_aware.py;
    tests/unit/serve/test_kv_routing.py has the router's side)."""
    prompt = "An adapter's own blocks: " + OPENINGS[2] * 2
    body = {"model": f"{BIG}:{ADAPTER}", "prompt": prompt, "max_tokens": 2}
    response = httpx.post(f"{kv_app.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    complete(kv_app.url, BIG, prompt)  # the base's blocks of the same tokens
    tokens = _blocks(tokenizer.encode(prompt))[0]
    names = {}
    for replica in replicas_of(kv_app, BIG):
        for event in replayed_events(kv_endpoints(replica)[1]):
            if event["type"] == "BlockStored" and event["token_ids"][:16] == tokens:
                names.setdefault(event.get("lora_name"), set()).add(event["block_hashes"][0])
    adapter_names = [name for name in names if name is not None]
    assert adapter_names == [str(read_adapter(str(adapters_dir), ADAPTER).task_id)], names
    assert None in names and names[None].isdisjoint(names[adapter_names[0]])


def test_a_killed_replicas_blocks_leave_the_index(kv_app):
    """The replica holding a prompt dies: its worker leaves the router's index, its
    replacement starts empty, and the prompt's next request finds no replica holding it
    (routed by load, not to a ghost)."""
    prompt = "A replica that dies: " + OPENINGS[3] * 2
    urls = [triton_http_url(r, port="metrics") for r in replicas_of(kv_app, SMALL)]
    complete(kv_app.url, SMALL, prompt)
    before = settled_counters(urls)
    complete(kv_app.url, SMALL, prompt)
    holder = served_by(urls, before)
    os.kill(replicas_of(kv_app, SMALL)[holder]["pid"], signal.SIGKILL)
    wait_for_router(kv_app.url, lambda m: m.get(("workers", SMALL, "")) == 1)
    deadline = time.monotonic() + 180
    while len(kv_app.running_replicas("llm", f"Triton-{SMALL}")) < 2:
        assert time.monotonic() < deadline, "the lost replica was not replaced"
        time.sleep(1)
    wait_for_router(kv_app.url, lambda m: m.get(("workers", SMALL, "")) == 2)
    # Both requests went to the holder (the second by its overlap): nobody holds it now.
    metrics = router_metrics(kv_app.url)
    complete(kv_app.url, SMALL, prompt)
    wait_for_router(kv_app.url, routed(kv_app.url, SMALL, metrics, "no_overlap"))
