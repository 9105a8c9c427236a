"""``python -m bench.kv_events``: what routing: kv_aware costs, in-process.

- The engine thread, per block its prefix cache stores: ``PrefixCache.save`` of
  ``--prompt-tokens``-token prompts with the event publisher and without it, side by
  side (the publisher's own thread hashes, encodes and sends meanwhile).
- The router, per request: ``KvScorer.choose`` (Dynamo's overlap scores over two
  replicas whose engines publish, the choice), on an event loop as the router's.

Both alternate the variants ``--rounds`` times and print the medians; the per-token
figures divide by the answer length of ``make bench-capacity`` (64 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from types import SimpleNamespace

import torch
from ray.serve._private.common import DeploymentID, ReplicaID

from serve.engines.triton.launcher import free_port
from serve.generation import GenerateParams
from serve.routing import kv_index
from tritonllm.engine.kv_cache import SlotKVCache
from tritonllm.engine.kv_events import KVEventPublisher
from tritonllm.engine.prefix_cache import PrefixCache

BLOCK = 16


def engine_seconds_per_block(prompts: int, prompt_tokens: int, publish: bool) -> float:
    """Engine-thread seconds per block ``save`` stores, with a small model's cache."""
    # The bench model's cache (10 layers, 4 KV heads of 64): 20 KiB a token.
    cache = SlotKVCache(10, 1, 4, 64, prompt_tokens, torch.float32, torch.device("cpu"))
    prefix = PrefixCache(cache, 4 * prompt_tokens // BLOCK, BLOCK)  # four prompts' blocks
    publisher = None
    if publish:
        endpoints = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        publisher = KVEventPublisher(*endpoints, BLOCK)
        prefix.events = publisher
    try:
        started = time.perf_counter()
        for i in range(prompts):  # each prompt new: every block stored, older ones evicted
            prefix.save(cache, 0, [i * prompt_tokens + t for t in range(prompt_tokens)])
        return (time.perf_counter() - started) / (prompts * (prompt_tokens // BLOCK))
    finally:
        if publisher is not None:
            publisher.close()


async def router_seconds_per_request(requests: int, prompt_tokens: int) -> float:
    """Seconds per request of choosing the replicas to route it among, two replicas'
    engines publishing and half the prompts cached on one of them."""
    scorer = kv_index.KvScorer("bench", "unused: the requests carry token ids")
    loop = asyncio.get_running_loop()
    publishers, replicas = [], []
    for name in ("a", "b"):
        pub, replay = free_port(), free_port()
        publishers.append(KVEventPublisher(f"tcp://*:{pub}", f"tcp://*:{replay}", BLOCK))
        replicas.append(_replica(name, pub, replay))
    scorer.index.follow(replicas, loop)
    prompts = [tuple(range(i * prompt_tokens, (i + 1) * prompt_tokens)) for i in range(requests)]
    blocks = [
        [(n, p[n * BLOCK : (n + 1) * BLOCK]) for n in range(len(p) // BLOCK)] for p in prompts
    ]
    for n, chain in enumerate(blocks[::2]):  # a's engine holds every other prompt
        publishers[0].stored(0, [(n * 1000 + i, tokens) for i, tokens in chain], 0)
    await asyncio.sleep(1)  # indexed
    try:
        started = time.perf_counter()
        for prompt in prompts:
            params = GenerateParams(prompt="", max_tokens=64, prompt_token_ids=prompt)
            await scorer.choose(replicas, params)
        return (time.perf_counter() - started) / requests
    finally:
        for publisher in publishers:
            publisher.close()
        await scorer.index._service.shutdown_async()


def _replica(name: str, pub: int, replay: int):
    metadata = {
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "block_size": BLOCK,
        "max_num_batched_tokens": 8192,
    }
    return SimpleNamespace(
        replica_id=ReplicaID(name, DeploymentID("bench", "app")),
        routing_stats={kv_index.KV_EVENT_METADATA: metadata},
    )


def _us(seconds: list[float]) -> list[float]:
    return [round(1e6 * value, 1) for value in seconds]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_events", description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--requests", type=int, default=2000)
    args = p.parse_args(argv)
    engine = {False: [], True: []}
    router = []
    for _ in range(args.rounds):
        for publish in (False, True):
            engine[publish].append(
                engine_seconds_per_block(args.prompts, args.prompt_tokens, publish)
            )
        router.append(asyncio.run(router_seconds_per_request(args.requests, args.prompt_tokens)))
    off, on = (1e6 * statistics.median(engine[k]) for k in (False, True))
    per_request = 1e6 * statistics.median(router)
    print(f"engine thread per stored block: {off:.1f} us without events, {on:.1f} us with")
    print(f"  each round without: {_us(engine[False])}, with: {_us(engine[True])}")
    print(f"router per request (choose): {per_request:.1f} us, rounds {_us(router)}")
    print(f"  at 64-token answers: {per_request / 64:.2f} us per token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
