"""The tenants' rate limits in a real Redis, as two ingress replicas share them: one
bucket for both, and what a Redis that cannot be reached does (open or closed)."""

from __future__ import annotations

import asyncio

import pytest

from serve.api.errors import Overloaded
from serve.api.limits import RedisBuckets
from serve.triton.launcher import free_port
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
