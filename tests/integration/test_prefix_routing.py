"""routing: prefix_aware on a real cluster: two Triton replicas, each conversation's
turns go to the replica that already holds its prefix (read from each replica's own
Triton metrics), and that replica's prefix cache serves them."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster import serve_config, triton_http_url
from tests.integration.repositories import repository_with_limits
from tests.integration.test_production import (
    QUICK_SCALING,
    TRITON,
    Load,
    assert_ok_or_retryable,
    assert_survived,
    wait_for,
    wait_for_replicas,
)

pytestmark = pytest.mark.integration

# Four conversations that share no prefix (Ray's router sends a prompt that matches
# under 10% of its characters to the replica holding the least).
OPENINGS = [
    "The robot writes a long letter to the old town, and the teacher reads it aloud.",
    "Many small servers answer requests near the sea while the café opens at nine.",
    "A cat sleeps in the sun by the window; the dog and the old man walk to the river.",
    "In the morning the scheduler sends every request to a replica with a warm cache.",
]


def prefix_counters(metrics_url: str) -> tuple[float, float]:
    """A Triton's prompt tokens queried in and served from its prefix caches, summed
    over its engine models (a pool of variants has one per loaded variant)."""
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]


def settled_counters(urls: list[str], quiet_s: float = 1.0) -> list[tuple[float, float]]:
    """Each replica's counters once they stop moving: an engine flushes its metrics at
    most every 0.25 s and only on a step, so the abandoned streams' last counts may land
    a while after their clients left (seen on a loaded machine)."""
    deadline = time.monotonic() + 30
    counters = [prefix_counters(u) for u in urls]
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = [prefix_counters(u) for u in urls]
        if again == counters:
            return counters
        counters = again
    raise AssertionError(f"the replicas' prefix counters kept moving: {counters}")


def served_by(urls: list[str], before: list[tuple[float, float]]) -> int:
    """The replica whose prefix cache was queried since ``before`` (one request)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        grew = [i for i, u in enumerate(urls) if prefix_counters(u)[0] > before[i][0]]
        if grew:
            assert len(grew) == 1, grew
            return grew[0]
        time.sleep(0.05)
    raise AssertionError("no replica counted the request")


def test_each_conversation_stays_on_the_replica_holding_its_prefix(cluster, built_repository):
    deployment = {"autoscaling_config": None, "num_replicas": 2}
    cluster.deploy(serve_config(built_repository, routing="prefix_aware", deployment=deployment))
    cluster.wait_running(settled=True)
    replicas = cluster.running_replicas("llm", "Triton-tritonllm-default")
    urls = [triton_http_url(r, port="metrics") for r in replicas]
    assert len(urls) == 2
    replicas_of = {}
    for conversation, opening in enumerate(OPENINGS):
        prompt = opening
        for turn in range(3):
            prompt += f" Question {turn}: where did they go next?"
            before = [prefix_counters(u) for u in urls]
            body = {"model": "tritonllm-default", "prompt": prompt, "max_tokens": 4}
            response = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            replicas_of.setdefault(conversation, set()).add(served_by(urls, before))
    assert all(len(r) == 1 for r in replicas_of.values()), replicas_of
    assert set.union(*replicas_of.values()) == {0, 1}  # new conversations spread out
    hits = sum(prefix_counters(u)[1] for u in urls)
    assert hits >= len(OPENINGS) * 2 * 16  # turns 2 and 3 reused at least a block each


def held_stream(url: str, prompt: str, release: threading.Event) -> str:
    """A streamed completion of ``prompt`` that keeps its engine slot until ``release``,
    then is abandoned (which frees the slot). Its first event."""
    body = {"model": "tritonllm-default", "prompt": prompt, "stream": True}
    body |= {"max_tokens": 400, "min_tokens": 400}  # within the default model's 512
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        first = next((line for line in response.iter_lines() if line.startswith("data: ")), "")
        release.wait(120)
    return f"{response.status_code} {first}"


def test_a_busy_or_lost_replica_gives_way_to_the_other(cluster, checkpoint_dir, tmp_path):
    """Affinity yields to load (an engine batch of imbalance) and to replica loss (the
    ingress retries once a request whose replica died before answering, and the retry
    goes elsewhere)."""
    # Two sequences per engine: the router balances once one replica has 2 more queued.
    repository = repository_with_limits(
        checkpoint_dir, tmp_path / "model_repository", "--max-batch-size", "2"
    )
    deployment = {
        "autoscaling_config": None,
        "num_replicas": 2,
        "health_check_period_s": 1,
        "health_check_timeout_s": 10,
    }
    cluster.deploy(serve_config(repository, routing="prefix_aware", deployment=deployment))
    cluster.wait_running(settled=True)
    replicas = cluster.running_replicas("llm", "Triton-tritonllm-default")
    urls = [triton_http_url(r, port="metrics") for r in replicas]
    prompt = OPENINGS[0] + " Question 0: where did they go next?"

    body = {"model": "tritonllm-default", "prompt": prompt, "max_tokens": 4}
    response = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text  # one replica holds the prefix now
    # Six long streams of the same conversation at once: affinity alone would queue all
    # six on the replica holding the prefix (its engine admits two); the router sends
    # the rest by load.
    before = [prefix_counters(u) for u in urls]
    release = threading.Event()
    with ThreadPoolExecutor(6) as pool:
        held = [pool.submit(held_stream, cluster.url, prompt, release) for _ in range(6)]
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            admitted = [prefix_counters(u)[0] > b[0] for u, b in zip(urls, before, strict=True)]
            if all(admitted):
                break
            time.sleep(0.5)
        release.set()
        firsts = [f.result(timeout=180) for f in held]
        assert all(f.startswith("200 ") and "choices" in f for f in firsts), firsts
    assert all(admitted), "every stream queued on the replica holding the prefix"

    # Both replicas now hold the prefix. The one serving the next turn dies (its Triton
    # with it) while the turn is in flight, nothing answered yet: the ingress retries it
    # once, and the router sends the retry to the other replica, not back to the dead
    # one that holds the prefix; Serve replaces the lost one.
    before = settled_counters(urls)
    body = {"model": "tritonllm-default", "prompt": prompt, "max_tokens": 300}
    body["min_tokens"] = 300  # a few seconds of decoding: time to kill its replica
    with ThreadPoolExecutor(1) as pool:
        turn = pool.submit(httpx.post, f"{cluster.url}/v1/completions", json=body, timeout=150)
        victim = served_by(urls, before)
        os.kill(replicas[victim]["pid"], signal.SIGKILL)
        response = turn.result(timeout=180)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 300
    survivor = 1 - victim
    assert prefix_counters(urls[survivor])[0] > before[survivor][0]  # the retry ran there
    # The next turn goes to the survivor at once (the router dropped the dead replica).
    body = {"model": "tritonllm-default", "prompt": prompt, "max_tokens": 4}
    before = prefix_counters(urls[survivor])
    response = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert served_by([urls[survivor]], [before]) == 0
    deadline = time.monotonic() + 180
    while len(cluster.running_replicas("llm", "Triton-tritonllm-default")) < 2:
        assert time.monotonic() < deadline, "the lost replica was not replaced"
        time.sleep(1)


class Conversations(Load):
    """``clients`` threads, each holding one conversation after another: a fresh
    opening, then ``turns`` turns that resend the conversation so far."""

    def __init__(self, url: str, clients: int, first: int, turns: int = 3):
        super().__init__(url, clients, max_tokens=16)
        self._numbers = itertools.count(first)  # next() is atomic under the GIL
        self.turns = turns

    def bodies(self) -> Iterator[dict]:
        while True:
            number = next(self._numbers)
            prompt = f"{number}: {OPENINGS[number % len(OPENINGS)]}"
            for turn in range(self.turns):
                prompt += f" Question {turn}: where did they go next?"
                yield {**self.body, "prompt": prompt}


def test_autoscaling_adds_a_replica_that_takes_conversations_and_scales_in_losing_none(
    cluster, built_repository
):
    """Prefix affinity does not pin a growing load to the first replica (new
    conversations go to the replica whose prefix tree holds least), and the replica
    that leaves takes no request with it (the router drops it from its tree)."""
    deployment = {"autoscaling_config": QUICK_SCALING}
    cluster.deploy(serve_config(built_repository, routing="prefix_aware", deployment=deployment))
    cluster.wait_running(settled=True)
    assert len(cluster.running_replicas("llm", TRITON)) == 1
    with Conversations(cluster.url, clients=1, first=0) as light:
        with Conversations(cluster.url, clients=5, first=1000) as heavy:
            replicas = wait_for_replicas(cluster, 2, "a second replica under load")
            urls = [triton_http_url(r, port="metrics") for r in replicas]
            wait_for(
                lambda: all(prefix_counters(u)[0] > 0 for u in urls),
                60,
                "both replicas served conversations",
            )
        # One conversation at a time is under the target: back to one replica.
        wait_for_replicas(cluster, 1, "scaled in")
        scaled_in = time.monotonic()
        time.sleep(3)
    assert_survived(light, scaled_in)
    assert all(not isinstance(r, Exception) for r in heavy.responses()), "a request hung"
    for response in heavy.responses():
        assert_ok_or_retryable(response)
