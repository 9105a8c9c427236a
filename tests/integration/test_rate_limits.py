"""The tenants' rate limits in a real Redis, as two ingress replicas share them: one
bucket for both, and what a Redis that cannot be reached does (open or closed)."""

from __future__ import annotations

import asyncio

import pytest

from serve.api.common.errors import Overloaded
from serve.api.common.limits import MemoryBuckets, RedisBuckets
from serve.engines.triton.launcher import free_port
from tests.integration.cluster import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer().start()
    yield f"redis://{server.address}/0"
    server.stop()


def test_two_replicas_share_one_bucket(redis_url):
    async def run() -> list[bool]:
        replicas = [RedisBuckets(redis_url, "test:limits:") for _ in range(2)]
        taken = [await replicas[i % 2].take("shared", 30) for i in range(31)]
        for replica in replicas:
            await replica.close()
        return taken

    taken = asyncio.run(run())
    assert [q.allowed for q in taken] == [True] * 30 + [False], taken
    assert taken[0].remaining == 29 and taken[29].remaining == 0
    assert 1.5 < taken[30].retry_after_s <= 2.0  # one request refills in 2 s at 30 a minute


def test_tokens_are_taken_settled_and_refused_as_the_memory_store_does(redis_url):
    """The Lua script and MemoryBuckets: the same figures for one sequence of takes
    and settlements (a reservation, a give-back, a charge past it, one too large)."""

    async def run(buckets) -> list[tuple]:
        seen = []
        for amount, settle in [(60, -50), (80, 30), (200, None), (70, None), (1000, None)]:
            quota = await buckets.take("tokens", 100, amount, "tokens")
            seen.append((quota.allowed, quota.remaining, round(quota.retry_after_s, 1)))
            if settle is not None and quota.allowed:
                await buckets.settle("tokens", 100, settle)
        return seen

    async def in_redis():
        buckets = RedisBuckets(redis_url, "test:tokens:")
        try:
            return await run(buckets), buckets.reachable
        finally:
            await buckets.close()

    in_memory = asyncio.run(run(MemoryBuckets()))
    seen, reachable = asyncio.run(in_redis())
    assert reachable
    assert [s[:2] for s in seen] == [s[:2] for s in in_memory], (seen, in_memory)
    # 60 taken, 50 back (90); 80 taken (10), 30 more charged (-20): 200 never fits,
    # 70 waits for 90 tokens to refill (54 s at 100 a minute), 1000 never fits.
    assert seen[:2] == [(True, 40, 0.0), (True, 10, 0.0)]
    assert seen[2][0] is False and seen[2][2] == float("inf")
    assert seen[3][0] is False and 53 < seen[3][2] <= 54.1
    assert seen[4][2] == float("inf")


@pytest.mark.parametrize("fail_open", [True, False])
def test_an_unreachable_redis_lets_in_or_refuses_as_configured(fail_open):
    async def take():
        buckets = RedisBuckets(f"redis://127.0.0.1:{free_port()}/0", "x:", fail_open)
        try:
            return await buckets.take("t", 10)
        finally:
            await buckets.close()

    if fail_open:
        assert asyncio.run(take()).allowed
    else:
        with pytest.raises(Overloaded):
            asyncio.run(take())


def test_seats_are_shared_by_replicas_given_back_and_lapse(redis_url):
    """Two replicas' requests at once share one tenant's seats; a seat given back lets
    the next in, and one whose replica died (never given back) lapses."""

    async def run():
        replicas = [RedisBuckets(redis_url, "test:seats:", seat_s=1.0) for _ in range(2)]
        first = await replicas[0].enter("t:at-once", 2)
        second = await replicas[1].enter("t:at-once", 2)
        third = await replicas[0].enter("t:at-once", 2)
        await replicas[1].leave("t:at-once", second)
        fourth = await replicas[0].enter("t:at-once", 2)
        full = await replicas[1].enter("t:at-once", 2)
        await asyncio.sleep(1.2)  # first and fourth never given back: lapsed
        lapsed = await replicas[1].enter("t:at-once", 2)
        for replica in replicas:
            await replica.close()
        return first, second, third, fourth, full, lapsed

    first, second, third, fourth, full, lapsed = asyncio.run(run())
    assert first and second and third is None
    assert fourth and full is None and lapsed
