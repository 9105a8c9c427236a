"""The prefix cache's KV cache events: vLLM's wire (ZMQ PUB frames, msgpack batches,
the replay socket), what they say against what the cache holds, and Dynamo's own
indexer reading them."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from serve.engines.triton.launcher import free_port
from tests.unit.tritonllm.engine.test_prefix_cache import BLOCK, fill, pool
from tritonllm.engine.kv_events import END_OF_REPLAY, KVEventPublisher

LORA_ROOT = ("lora", 7, 12345)  # an adapter's chain root: ("lora", uid, task id)


def free_ports(count: int) -> list[int]:
    return [free_port() for _ in range(count)]


@pytest.fixture
def published():
    """A pool of 4 blocks publishing, and a subscriber to its PUB socket."""
    pub_port, replay_port = free_ports(2)
    publisher = KVEventPublisher(f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", BLOCK, topic="kv")
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.3)  # ZMQ's slow joiner: the PUB drops what it sends before this
    prefix, cache = pool(4)
    prefix.events = publisher
    yield prefix, cache, subscriber, (pub_port, replay_port)
    publisher.close()
    context.destroy(linger=0)


def receive(subscriber, count: int) -> list[dict]:
    """The next ``count`` block events, whichever batches carry them (the publisher
    sends what the engine told it since its last batch). The first batch, the clean
    slate of a new engine, went before the subscriber joined (the replay has it)."""
    events = []
    while len(events) < count:
        assert subscriber.poll(5000), f"{len(events)} of {count} events published"
        topic, seq, payload = subscriber.recv_multipart()
        assert topic == b"kv" and int.from_bytes(seq, "big") > 0
        timestamp, batch, rank = msgspec.msgpack.decode(payload)
        assert timestamp > 0 and rank is None
        events.extend(batch)
    assert len(events) == count
    return events


def saved(prefix, cache, tokens, root=0, slot=0):
    fill(cache, slot, tokens)
    prefix.save(cache, slot, tokens, root)


def test_stored_and_removed_events_say_what_the_cache_holds(published):
    prefix, cache, subscriber, _ = published
    a, b = list(range(1, 13)), list(range(101, 109))  # 3 blocks, then 2: one evicted
    saved(prefix, cache, a)
    saved(prefix, cache, b, slot=1)
    saved(prefix, cache, a[:8])  # cached already: nothing to tell
    events = receive(subscriber, 3)
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "BlockStored"]
    stored_a, removed, stored_b = events
    assert stored_a["token_ids"] == a and stored_a["block_size"] == BLOCK
    assert stored_a["parent_block_hash"] is None and len(stored_a["block_hashes"]) == 3
    assert "lora_name" not in stored_a  # the base model's
    assert stored_b["token_ids"] == b and len(stored_b["block_hashes"]) == 2
    # The pool held 4: a's last block (its least recent leaf) made room for b's second.
    assert removed["block_hashes"] == [stored_a["block_hashes"][2]]
    live = set(stored_a["block_hashes"][:2] + stored_b["block_hashes"])
    assert len(live) == prefix.cached_blocks == 4
    assert not subscriber.poll(300)  # a[:8] was a hit: no event


def test_a_chain_extended_names_its_parent_and_an_adapters_blocks_are_its_own(published):
    prefix, cache, subscriber, _ = published
    tokens = list(range(1, 9))
    saved(prefix, cache, tokens[:4])
    saved(prefix, cache, tokens)  # one block more, after the first
    first, second = receive(subscriber, 2)
    assert second["parent_block_hash"] == first["block_hashes"][0]
    assert second["token_ids"] == tokens[4:]
    saved(prefix, cache, tokens[:4], root=LORA_ROOT)  # the same tokens, under an adapter
    (adapter,) = receive(subscriber, 1)
    assert adapter["lora_name"] == "12345" and adapter["lora_id"] == 12345
    assert adapter["block_hashes"] != first["block_hashes"]


def test_two_engines_holding_the_same_prefix_publish_the_same_hashes(published):
    prefix, cache, subscriber, _ = published
    saved(prefix, cache, list(range(1, 9)))
    events = receive(subscriber, 1)
    other_port, other_replay = free_ports(2)
    other = KVEventPublisher(f"tcp://*:{other_port}", f"tcp://*:{other_replay}", BLOCK)
    try:
        hashes = other._event(("stored", 0, [(1, (1, 2, 3, 4)), (2, (5, 6, 7, 8))], 0))
        assert hashes.block_hashes == events[0]["block_hashes"]
    finally:
        other.close()


def test_the_replay_socket_resends_buffered_batches_then_its_end_marker(published):
    prefix, cache, subscriber, (_, replay_port) = published
    saved(prefix, cache, list(range(1, 5)))
    received = receive(subscriber, 1)
    saved(prefix, cache, list(range(11, 15)))
    received += receive(subscriber, 1)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        assert [s for s, _ in replayed] == [0, 1, 2]
        events = [event for _, (_, batch, _) in replayed for event in batch]
        assert events == [{"type": "AllBlocksCleared"}, *received]
    finally:
        context.destroy(linger=0)


def test_dynamos_indexer_reads_the_events_and_scores_the_engine_that_holds_a_prefix():
    """Dynamo's SelectionService dials two publishing pools: a prompt goes to the one
    holding its prefix, an adapter's prompt scores only its adapter's blocks, and an
    evicted block leaves the index."""
    llm = pytest.importorskip("dynamo.llm")
    asyncio.run(_indexed_pools(llm.SelectionService))


async def _indexed_pools(selection_service):
    service = selection_service(indexer_threads=1)
    pools = []
    for worker_id in (1, 2):
        pub, replay = free_ports(2)
        publisher = KVEventPublisher(f"tcp://*:{pub}", f"tcp://*:{replay}", BLOCK)
        prefix, cache = pool(4)
        prefix.events = publisher
        pools.append((prefix, cache, publisher))
        await service.upsert_worker(_worker(worker_id, pub, replay))
    try:
        await asyncio.sleep(0.5)
        prompt = list(range(1, 13))
        saved(*pools[1][:2], prompt)  # worker 2 holds the prompt's 3 blocks
        saved(*pools[0][:2], prompt[:4], root=LORA_ROOT)  # worker 1: its first, as an adapter
        scores = await _eventually(service, prompt, None, lambda s: s.get(2) == 3)
        assert scores.get(1, 0) == 0
        choice = await service.select(
            {"model_name": "m", "tenant_id": "t", "token_ids": prompt, "allowed_worker_ids": [1, 2]}
        )
        assert choice["worker_id"] == 2
        await _eventually(service, prompt, "12345", lambda s: s.get(1) == 1 and not s.get(2))
        saved(*pools[1][:2], list(range(101, 113)), slot=1)  # 3 new blocks: 2 of prompt's go
        await _eventually(service, prompt, None, lambda s: s.get(2) == 1)
    finally:
        for _, _, publisher in pools:
            publisher.close()
        await service.shutdown_async()


def _worker(worker_id: int, pub: int, replay: int) -> dict:
    return {
        "worker_id": worker_id,
        "model_name": "m",
        "tenant_id": "t",
        "endpoint": f"test://{worker_id}",
        "block_size": BLOCK,
        "max_num_batched_tokens": 256,
        "data_parallel_start_rank": 0,
        "data_parallel_size": 1,
        "kv_events_endpoints": {0: f"tcp://127.0.0.1:{pub}"},
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }


async def _eventually(service, tokens, lora_name, check, timeout_s=10.0) -> dict[int, int]:
    """The workers' cached blocks of ``tokens`` once ``check`` holds (events are
    indexed a little after they are sent)."""
    request = {"model_name": "m", "tenant_id": "t", "token_ids": tokens}
    if lora_name:
        request["lora_name"] = lora_name
    deadline = time.monotonic() + timeout_s
    while True:
        answer = await service.overlap_scores(request)
        scores = {w["worker_id"]: w.get("device_blocks", 0) for w in answer["workers"]}
        if check(scores) or time.monotonic() > deadline:
            assert check(scores), scores
            return scores
        await asyncio.sleep(0.1)


def test_an_indexer_that_joins_late_gets_what_it_missed_from_the_replay_socket():
    """A router started after the engine stored blocks (a restarted ingress): the first
    live batch it sees shows the gap, and the replay fills it."""
    llm = pytest.importorskip("dynamo.llm")
    asyncio.run(_late_indexer(llm.SelectionService))


async def _late_indexer(selection_service):
    pub, replay = free_ports(2)
    publisher = KVEventPublisher(f"tcp://*:{pub}", f"tcp://*:{replay}", BLOCK)
    prefix, cache = pool(8)
    prefix.events = publisher
    early = list(range(1, 13))
    saved(prefix, cache, early)  # 3 blocks before anyone listens
    await asyncio.sleep(0.3)
    service = selection_service(indexer_threads=1)
    try:
        await service.upsert_worker(_worker(1, pub, replay))
        await asyncio.sleep(0.5)
        saved(prefix, cache, list(range(101, 105)), slot=1)  # the next live batch
        await _eventually(service, early, None, lambda s: s.get(1) == 3)
    finally:
        publisher.close()
        await service.shutdown_async()
