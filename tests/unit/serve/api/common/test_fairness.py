"""Fair shares (serve/api/common/fairness.py): who gets a freed seat, by priority, then by
tenant weight over tokens; waiters that leave; requests of several engine calls."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from serve.api.common.fairness import QUANTUM, FairQueue, QueueFull
from serve.api.common.keyring import Caller
from serve.api.common.metered import SeatedBackend
from serve.app import fair_seats
from serve.config import AppConfig
from serve.generation import GenerateParams


def _in_a_loop(test):
    """The project's tests run coroutines with asyncio.run (no pytest plugin)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


async def _queued(queue: FairQueue, requests: list[tuple[str, float, int, int]]):
    """Each (tenant, weight, priority, cost) asks for a seat, in order, while the
    queue's seats are all taken; returns the tasks and the order their seats came in."""
    granted: list[int] = []

    async def ask(i, tenant, weight, priority, cost):
        seat = await queue.seat(tenant, weight, priority, cost)
        granted.append(i)
        return seat

    tasks = [asyncio.create_task(ask(i, *r)) for i, r in enumerate(requests)]
    await asyncio.sleep(0)
    return tasks, granted


async def _serve_one_at_a_time(tasks, granted: list[int], count: int) -> None:
    """Gives back the last granted seat ``count`` times, each time letting the next
    waiter in."""
    for _ in range(count):
        tasks[granted[-1]].result().give_back()
        await asyncio.sleep(0)


@_in_a_loop
async def test_a_free_seat_is_taken_at_once_and_the_rest_wait_first_come_first_served():
    waits = []
    queue = FairQueue(2, on_wait=lambda tenant, seconds: waits.append((tenant, seconds)))
    first = await queue.seat("a", 1.0, 0, 10)
    second = await queue.seat("a", 1.0, 0, 10)
    assert queue.taken == 2 and waits == [("a", 0.0), ("a", 0.0)]
    tasks, granted = await _queued(queue, [("a", 1.0, 0, 10)] * 3)
    assert granted == [] and queue.waiting == 3
    first.give_back()
    second.give_back()
    await asyncio.sleep(0)
    assert granted == [0, 1] and queue.taken == 2 and queue.waiting == 1
    for task in tasks[:2]:
        (await task).give_back()
    await asyncio.sleep(0)
    assert granted == [0, 1, 2]
    (await tasks[2]).give_back()
    assert queue.taken == 0 and len(waits) == 5 and all(s >= 0 for _, s in waits)


async def _flooded(queue: FairQueue, requests):
    """``requests`` queued behind a seat held, then every seat granted at once (a
    tenant's share) given back: the rest are granted by the queue's order alone."""
    holder = await queue.seat("x", 1.0, 0, 1)
    tasks, granted = await _queued(queue, requests)
    at_once = list(granted)
    holder.give_back()
    for i in at_once:
        tasks[i].result().give_back()
    await asyncio.sleep(0)
    return tasks, granted, at_once


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0)])
@_in_a_loop
async def test_tenants_waiting_share_freed_seats_in_proportion_to_their_weights(weights):
    queue = FairQueue(1)
    # Tenant a floods first; b's requests arrive behind all of a's.
    requests = [("a", weights[0], 0, 500)] * 60 + [("b", weights[1], 0, 500)] * 60
    tasks, granted, at_once = await _flooded(queue, requests)
    # Each tenant's first request was within its share: at once, past the seat.
    assert at_once == [0, 60]
    await _serve_one_at_a_time(tasks, granted, 39)
    counts = Counter(requests[i][0] for i in granted[2:])
    share_b = weights[1] / sum(weights)
    assert sum(counts.values()) == 40
    assert abs(counts["b"] / 40 - share_b) <= 0.1, counts
    for task in tasks:
        task.cancel()


@_in_a_loop
async def test_a_tenant_within_its_share_never_waits_for_another_tenants_flood():
    queue = FairQueue(4)
    flood = [await queue.seat("a", 1.0, 0, 100) for _ in range(4)]
    tasks, granted = await _queued(queue, [("a", 1.0, 0, 100)] * 50)
    assert granted == [] and queue.taken == 4
    mine = [await asyncio.wait_for(queue.seat("b", 1.0, 0, 100), 1) for _ in range(2)]
    assert queue.taken == 6  # b's share, 2 of 4 seats, past the seats
    extra = asyncio.create_task(queue.seat("b", 1.0, 0, 100))
    await asyncio.sleep(0)
    assert not extra.done()  # past its share b waits as a does
    for seat in [*flood, *mine]:
        seat.give_back()
    await asyncio.sleep(0)
    # Then freed seats go round the tenants waiting: b's turn comes after one of a's
    # quanta at most.
    while not extra.done():
        tasks[granted[-1]].result().give_back()
        await asyncio.sleep(0)
    assert len(granted) <= QUANTUM // 100 + 1  # a's, before b's
    for task in [*tasks, extra]:
        task.cancel()


@_in_a_loop
async def test_shares_are_tokens_not_requests():
    queue = FairQueue(1)
    requests = [("big", 1.0, 0, 2000)] * 30 + [("small", 1.0, 0, 200)] * 300
    tasks, granted, at_once = await _flooded(queue, requests)
    await _serve_one_at_a_time(tasks, granted, 109)
    tokens = Counter()
    for i in granted[len(at_once) :]:
        tokens[requests[i][0]] += requests[i][3]
    assert 0.75 <= tokens["big"] / tokens["small"] <= 1.34, tokens
    for task in tasks:
        task.cancel()


@_in_a_loop
async def test_the_most_urgent_priority_goes_first_then_tenants_in_turn():
    queue = FairQueue(1)
    holder = await queue.seat("a", 1.0, 0, 1)
    requests = [("a", 1.0, 5, 100)] * 3 + [("a", 1.0, 0, 2000)] * 2 + [("a", 1.0, -1, 100)]
    tasks, granted = await _queued(queue, requests)
    assert granted == []  # one tenant: its share is every seat
    holder.give_back()
    await asyncio.sleep(0)
    await _serve_one_at_a_time(tasks, granted, 5)
    assert granted == [5, 3, 4, 0, 1, 2]
    (await tasks[2]).give_back()
    assert queue.taken == 0 and queue.waiting == 0


@_in_a_loop
async def test_a_waiter_that_leaves_takes_no_seat_and_a_seat_granted_as_it_left_comes_back():
    queue = FairQueue(1)
    holder = await queue.seat("a", 1.0, 0, 1)
    tasks, granted = await _queued(queue, [("a", 1.0, 0, 1)] * 3)
    tasks[0].cancel()
    await asyncio.sleep(0)
    assert queue.waiting == 2
    holder.give_back()  # grants b's first; its task is cancelled before it resumes
    tasks[1].cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert granted == [2] and queue.taken == 1 and queue.waiting == 0
    (await tasks[2]).give_back()
    assert queue.taken == 0


@_in_a_loop
async def test_a_request_of_several_engine_calls_never_waits_holding_a_seat():
    """Its further calls take seats past the queue's (others wait until they end)."""
    queue = FairQueue(1)
    seat = await queue.seat("a", 1.0, 0, 10)
    seat.widen(10)
    seat.widen(10)
    assert queue.taken == 3
    tasks, granted = await _queued(queue, [("a", 1.0, 0, 10)])
    assert granted == []
    seat.give_back()
    seat.give_back()  # twice: once
    await asyncio.sleep(0)
    assert granted == [0] and queue.taken == 1
    (await tasks[0]).give_back()


@_in_a_loop
async def test_past_max_waiting_a_request_gets_the_503_of_a_full_queue():
    queue = FairQueue(1, max_waiting=2)
    holder = await queue.seat("a", 1.0, 0, 1)
    tasks, granted = await _queued(queue, [("a", 1.0, 0, 1)] * 2)
    with pytest.raises(QueueFull) as refused:
        await queue.seat("a", 1.0, 0, 1)
    assert refused.value.status == 503 and refused.value.headers() == {"Retry-After": "1"}
    tasks[0].cancel()
    await asyncio.sleep(0)
    waiting = asyncio.create_task(queue.seat("a", 1.0, 0, 1))  # room again
    await asyncio.sleep(0)
    assert queue.waiting == 2 and not waiting.done()
    holder.give_back()
    await asyncio.sleep(0)
    assert granted == [1]
    for task in [*tasks, waiting]:
        task.cancel()


class _Engine:
    """The backend's generations: each holds an engine slot until its stream is read."""

    def __init__(self, queue: FairQueue):
        self.fair_queues = {"m": queue}
        self.started = 0

    async def start(self, model, params):
        self.started += 1

        async def rest():
            yield params.prompt

        return params.prompt, rest()

    async def collect(self, model, params):
        self.started += 1
        await asyncio.sleep(0.01)
        return params.prompt, None


@_in_a_loop
async def test_a_request_with_more_prompts_than_seats_starts_them_all():
    """The deadlock of a seat per engine call: the routes start every prompt before
    they read any stream."""
    queue = FairQueue(2)
    engine = _Engine(queue)
    request = Request({"type": "http", "headers": []})
    backend = SeatedBackend(engine, request, Caller("t", "tenant:t"))
    model = SimpleNamespace(id="m")
    prompts = [GenerateParams(prompt=f"p{i}", max_tokens=4) for i in range(5)]
    started = await asyncio.wait_for(
        asyncio.gather(*(backend.start(model, p) for p in prompts)), timeout=5
    )
    assert len(started) == 5 and queue.taken == 5
    collected = await asyncio.wait_for(
        asyncio.gather(*(backend.collect(model, p) for p in prompts)), timeout=5
    )
    assert [text for text, _ in collected] == [p.prompt for p in prompts]
    (give_back,) = request.state.on_end  # one seat, however many calls
    give_back()
    assert queue.taken == 0


def test_each_model_gets_the_seats_its_replicas_run_at_their_target_per_ingress_replica():
    config = AppConfig.model_validate(
        {
            "ingress": {"num_replicas": 2},
            "models": [
                {
                    "id": "m",
                    "deployment": {
                        "autoscaling_config": {
                            "min_replicas": 1,
                            "max_replicas": 3,
                            "target_ongoing_requests": 16,
                        }
                    },
                },
            ],
        }
    )
    assert fair_seats(config) == {"m": 24}
    assert fair_seats(config.model_copy(update={"fair_shares": False})) == {}
