"""Production behaviour on a real cluster: ``ray start --head``, ``serve deploy``, real Triton.

Each test deploys the shipped serve/config.yaml with the fields under test changed,
drives it over HTTP and reads Serve's own state (its REST API), the app's /metrics
and the processes themselves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fuzzing import server_errors
from tests.grafana import queried_metrics
from tests.integration.cluster import (
    RedisServer,
    child_pids,
    cmdline,
    process_name,
    serve_config,
)
from tests.integration.repositories import repository_with_limits
from tritonllm import contract

pytestmark = pytest.mark.integration
MODEL = "tritonllm-default"
# Named tenants (docs/operations.md#tenants): b limited to the one model, c to 20
# requests a minute.
TENANTS = """
tenants:
  - name: a
    keys: [tenant-a-1, tenant-a-2]
  - name: b
    keys: [tenant-b-1]
    models: [tritonllm-default]
  - name: c
    keys: [tenant-c-1]
    requests_per_minute: 20
  - name: d
    keys: [tenant-d-1]
    tokens_per_minute: 120
"""
TRITON = f"Triton-{MODEL}"


def complete(url: str, timeout_s: float = 60, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The cat", "max_tokens": 16, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)


def stream_events(url: str, **body) -> list:
    """A streamed completion's events (dicts, then the string "[DONE]")."""
    body = {"model": MODEL, "prompt": "The cat", "stream": True, **body}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def assert_ok_or_retryable(response: httpx.Response) -> None:
    """Either an answer or a 503 the client can retry: never a 500, never a hang."""
    if response.status_code == 200:
        assert response.json()["choices"][0]["text"] is not None
        return
    assert response.status_code == 503, response.text
    assert "retry-after" in response.headers, (response.headers, response.text)
    assert response.json()["error"]["type"] == "server_error"


class Load:
    """``clients`` threads sending completions until stopped; every outcome is kept."""

    def __init__(self, url: str, clients: int, **body):
        self.url, self.body = url, body
        self.results: list = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def bodies(self) -> Iterator[dict]:
        """One client's requests, in order."""
        while True:
            yield self.body

    def _run(self) -> None:
        bodies = self.bodies()
        while not self._stop.is_set():
            try:
                response = complete(self.url, **next(bodies))
            except httpx.HTTPError as error:  # a timeout here is a failed test
                response = error
            self.results.append((time.monotonic(), response))
            if getattr(response, "status_code", 200) != 200:
                time.sleep(0.5)  # as a client honouring Retry-After would, roughly

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def responses(self, since: float = 0.0) -> list:
        return [r for t, r in self.results if t >= since]


def assert_survived(load: Load, recovered_at: float) -> None:
    """Every request of ``load`` answered or refused retryably (none hung), and only
    answers once the replacement replica has run for 2 s."""
    outcomes = load.responses()
    assert not [r for r in outcomes if isinstance(r, Exception)], "a request failed or hung"
    for response in outcomes:
        assert_ok_or_retryable(response)
    after = [r.status_code for r in load.responses(since=recovered_at + 2)]
    assert after and set(after) == {200}, after


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def triton_pid(replica: dict) -> int:
    tritons = [p for p in child_pids(replica["pid"]) if process_name(p) == "tritonserver"]
    assert len(tritons) == 1, tritons
    return tritons[0]


def listening_addresses(pid: int) -> set[str]:
    """``ip:port`` of the TCP sockets ``pid`` listens on (IPv4, from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            ip_hex, port_hex = fields[1].split(":")
            ip = ".".join(str(int(ip_hex[i : i + 2], 16)) for i in (6, 4, 2, 0))
            addresses.add(f"{ip}:{int(port_hex, 16)}")
    return addresses


def metric_values(text: str, name: str, **labels) -> list[tuple[dict, float]]:
    """Samples of ``name`` whose labels include ``labels``."""
    samples = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body, value = line[len(name) + 1 :].rsplit("} ", 1)
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', body))
        if all(found.get(k) == v for k, v in labels.items()):
            samples.append((found, float(value)))
    return samples


def test_a_deployed_app_serves_with_request_ids_metrics_and_loopback_triton(
    cluster, built_repository
):
    cluster.deploy(serve_config(built_repository, deployment={"autoscaling_config": None}))
    details = cluster.wait_running(settled=True)  # the app's figures alone: no replica before
    triton = details["deployments"][TRITON]
    assert triton["deployment_config"]["graceful_shutdown_timeout_s"] == pytest.approx(
        512 * 0.2 + 30
    )
    response = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": MODEL, "prompt": "The cat", "max_tokens": 8},
        headers={"x-request-id": "trace-0042"},
        timeout=60,
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-0042"
    assert complete(cluster.url, max_tokens=100000).status_code == 400
    assert stream_events(cluster.url, max_tokens=4)[-1] == "[DONE]"

    # Triton listens on loopback only.
    replica = cluster.running_replicas("llm", TRITON)[0]
    addresses = listening_addresses(triton_pid(replica))
    assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
    # It loads the engine step alone: the replica tokenizes and detokenizes itself.
    stubs = [cmdline(p).decode() for p in child_pids(triton_pid(replica))]
    assert len(stubs) == 1 and "/tensorrt_llm/1/model.py" in stubs[0], stubs

    # The request id is in the ingress's access line; the replica behind it logs none
    # of its own (access_log unset: off behind the ingress).
    logs = cluster.logs_dir() / "serve"
    logged = [p.name for p in logs.glob("replica_*.log") if "trace-0042" in p.read_text()]
    assert any("OpenAIIngress" in name for name in logged), logged
    assert not any(TRITON in name for name in logged), logged

    counted = (
        "tritonllm_time_to_first_token_seconds_count",
        "tritonllm_inter_token_latency_seconds_count",
        "tritonllm_e2e_latency_seconds_count",
        "tritonllm_generated_tokens_total",
        "tritonllm_prompt_tokens_total",
        "tritonllm_engine_generated_tokens_total",
    )

    def exported():  # every process pushes to the collector every 5 s
        text = app_metrics(cluster.url)
        ok = metric_values(text, "tritonllm_requests_total", model=MODEL, status="200")
        bad = metric_values(text, "tritonllm_requests_total", model=MODEL, status="400")
        counts = [sum(v for _, v in metric_values(text, name)) for name in counted]
        # Triton's own counters too: a scrape taken mid-request has the engine's tokens
        # but not yet its success (the replica's requests go to the engine step:
        # triton.pipeline: replica).
        engine = metric_values(text, "nv_inference_request_success", model=contract.TENSORRT_LLM)
        return ok and bad and all(counts) and any(v for _, v in engine) and (text, engine)

    text, engine = wait_for(exported, 60, "request, latency, token and Triton metrics")
    (labels, _), *_ = engine
    assert labels["replica"] == replica["replica_id"] and labels["deployment"] == TRITON
    # Types survive the trip: Triton's counters stay counters under Triton's own names.
    for name, kind in [
        ("tritonllm_requests_total", "counter"),
        ("tritonllm_time_to_first_token_seconds", "histogram"),
        ("tritonllm_requests_running", "gauge"),
        ("nv_inference_request_success", "counter"),
        ("nv_inference_queue_duration_us", "counter"),
        ("tritonllm_engine_running_sequences", "gauge"),
    ]:
        assert f"# TYPE {name} {kind}\n" in text, name
    # Every series the shipped Grafana dashboard queries is there.
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert queried_metrics() <= samples, sorted(queried_metrics() - samples)


def app_metrics(url: str) -> str:
    """The app's GET /metrics (the API port): every process's figures."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return response.text


@pytest.fixture(scope="module")
def slow_repository(checkpoint_dir, tmp_path_factory) -> Path:
    """The null engine over the default checkpoint at 25 ms a step: a 400-token stream
    lasts 10 s on any machine, so a test's event meets it in flight (the torch model
    streams it in about 1.2 s here: it could end before the event)."""
    destination = tmp_path_factory.mktemp("slow")
    return repository_with_limits(
        checkpoint_dir, destination, "--target", "null", "--null-step-ms", "25"
    )


def test_past_the_queue_bound_clients_get_503_with_retry_after(cluster, slow_repository):
    cluster.deploy(
        serve_config(
            slow_repository,
            deployment={
                "autoscaling_config": None,
                "num_replicas": 1,
                "max_ongoing_requests": 2,
                "max_queued_requests": 2,
            },
        )
    )
    cluster.wait_running()
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: complete(cluster.url, max_tokens=48), range(16)))
    statuses = [r.status_code for r in responses]
    for response in responses:
        assert_ok_or_retryable(response)
    # Serve may refuse a little early under a burst (its router's own note on
    # max_queued_requests), so the counts are bounds, not exact figures.
    assert statuses.count(503) > 0 and statuses.count(200) >= 2, statuses
    assert complete(cluster.url).status_code == 200

    # /health reads Serve's replica states: it answers at once while both replica slots
    # hold long generations and a third waits in the queue (a call to the replica, as
    # /health made before, waited behind them).
    streaming = [threading.Event() for _ in range(3)]
    release = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(hold_stream, cluster.url, s, release) for s in streaming[:2]]
        wait_for(lambda: all(s.is_set() for s in streaming[:2]), 60, "two streams running")
        # Alone, so that Serve's router counts it against max_queued_requests alone.
        held.append(pool.submit(hold_stream, cluster.url, streaming[2], release))
        time.sleep(1)
        start = time.monotonic()
        health = httpx.get(f"{cluster.url}/health", timeout=30)
        elapsed = time.monotonic() - start
        queued = not streaming[2].is_set() and not held[2].done()  # still waiting
        release.set()
        assert all(f.result(timeout=120) for f in held)
    assert health.status_code == 200 and elapsed < 3, (health.text, elapsed)
    assert queued, "the third stream started before /health answered: nothing was proven"


def hold_stream(url: str, streaming: threading.Event, release: threading.Event) -> bool:
    """A long streamed completion: ``streaming`` is set at its first text, and it is
    held open until ``release``, then abandoned (which frees its engine slot)."""
    body = {"model": MODEL, "prompt": "The cat", "stream": True, "max_tokens": 480}
    body["min_tokens"] = 480
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()  # held: a dropped iterator closes the connection
        first = next((line for line in lines if line.startswith("data: ")), "")
        streaming.set()
        release.wait(120)
    return response.status_code == 200 and "choices" in first


def wait_for_replicas(cluster, count: int, what: str) -> list[dict]:
    """The model's running replicas once there are ``count`` (within 180 s)."""

    def running():
        replicas = cluster.running_replicas("llm", TRITON)
        return len(replicas) == count and replicas

    return wait_for(running, 180, what)


# One to two replicas, quick to react: two requests at once are a full replica.
QUICK_SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 1,
    "downscale_delay_s": 3,
    "look_back_period_s": 2,
}


def test_load_scales_out_to_a_second_replica_and_back(cluster, built_repository):
    deployment = {"autoscaling_config": QUICK_SCALING}
    cluster.deploy(serve_config(built_repository, deployment=deployment))
    cluster.wait_running()
    assert len(cluster.running_replicas("llm", TRITON)) == 1
    with Load(cluster.url, clients=8, max_tokens=64):
        replicas = wait_for_replicas(cluster, 2, "a second replica under load")

        def both_served():  # one scrape shows every replica's counters
            served = metric_values(
                app_metrics(cluster.url),
                "nv_inference_request_success",
                model=contract.TENSORRT_LLM,
            )
            return {labels["replica"] for labels, value in served if value > 0}

        ids = {r["replica_id"] for r in replicas}
        wait_for(lambda: ids <= both_served(), 90, "both replicas answered requests")
    wait_for_replicas(cluster, 1, "back to one replica")


def test_a_killed_triton_of_the_only_replica_is_replaced_and_its_stream_resumes(
    cluster, slow_repository
):
    """The replica exits with its Triton, Serve starts another, and the stream it was
    serving resumes there (with two replicas, on the other one: test_migration.py)."""
    cluster.deploy(
        serve_config(
            slow_repository,
            deployment={
                "autoscaling_config": None,
                "num_replicas": 1,
                "health_check_period_s": 1,
                "health_check_timeout_s": 10,
            },
        )
    )
    cluster.wait_running()
    victim = cluster.running_replicas("llm", TRITON)[0]
    with ThreadPoolExecutor(1) as pool, Load(cluster.url, clients=3, max_tokens=24) as load:
        long_stream = pool.submit(stream_events, cluster.url, max_tokens=400, min_tokens=400)
        time.sleep(3)
        assert not long_stream.done(), "the stream ended before its Triton was killed"
        os.kill(triton_pid(victim), signal.SIGKILL)
        killed_at = time.monotonic()

        def replaced():
            running = cluster.running_replicas("llm", TRITON)
            ids = {r["replica_id"] for r in running}
            return len(running) == 1 and victim["replica_id"] not in ids

        wait_for(replaced, 120, "the replica replaced")
        recovered_at = time.monotonic()
        time.sleep(5)
    assert_survived(load, recovered_at)
    assert recovered_at - killed_at < 120
    events = long_stream.result(timeout=120)  # its replica's Triton died mid-answer
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 100


def test_a_rolling_update_finishes_streams_in_flight_and_applies_the_new_config(
    cluster, slow_repository
):
    fixed = {"autoscaling_config": None, "num_replicas": 1, "graceful_shutdown_wait_loop_s": 0.5}
    cluster.deploy(serve_config(slow_repository, deployment=fixed))
    cluster.wait_running()
    assert complete(cluster.url, max_tokens=150).status_code == 200
    with ThreadPoolExecutor(3) as pool, Load(cluster.url, clients=1, max_tokens=4) as load:
        streams = [
            pool.submit(stream_events, cluster.url, max_tokens=400, min_tokens=400)
            for _ in range(3)
        ]
        time.sleep(2)  # the streams are running on the old replicas
        cluster.deploy(serve_config(slow_repository, max_tokens_cap=100, deployment=fixed))
        assert not any(s.done() for s in streams), "a stream ended before the update"
        wait_for(
            lambda: complete(cluster.url, max_tokens=150).status_code == 400,
            240,
            "the new max_tokens cap in force",
        )
        cluster.wait_running()
        for stream in streams:  # each stream ran to its end on the draining replica
            events = stream.result(timeout=240)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 100
        time.sleep(2)
    codes = [getattr(r, "status_code", r) for r in load.responses()]
    assert codes and set(codes) == {200}, codes  # none lost during the update
    assert complete(cluster.url, max_tokens=100).status_code == 200


def test_a_repository_that_fails_to_load_fails_the_deployment_with_tritons_reason(
    cluster, built_repository, checkpoint_dir, tmp_path
):
    broken = repository_with_limits(checkpoint_dir, tmp_path / "broken")
    config = broken / "tensorrt_llm" / "config.pbtxt"
    config.write_text(
        re.sub(
            r'(key: "engine_dir" value: \{ string_value: )"[^"]*"',
            r'\1"/nonexistent/engine"',
            config.read_text(),
        )
    )
    start = time.monotonic()
    cluster.deploy(serve_config(broken, deployment={"autoscaling_config": None}))

    def failed():
        details = cluster.applications().get("llm", {})
        return details.get("status") == "DEPLOY_FAILED" and details

    details = wait_for(failed, 240, "DEPLOY_FAILED")
    message = details["deployments"][TRITON]["message"]
    assert "failed to load 'tensorrt_llm'" in message, message
    assert "/nonexistent/engine has no config.json" in message
    assert time.monotonic() - start < 240

    # A repository never built fails at once, before any replica starts.
    unbuilt = tmp_path / "unbuilt"
    unbuilt.mkdir()
    cluster.deploy(serve_config(unbuilt, deployment={"autoscaling_config": None}))
    details = wait_for(failed, 60, "DEPLOY_FAILED for the unbuilt repository")
    assert "make engines" in details["message"], details["message"]

    # So does a tenants file that names a model the app does not serve, with its line.
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS.replace("models: [tritonllm-default]", "models: [gpt-9]"))
    config = serve_config(built_repository, deployment={"autoscaling_config": None})
    config["applications"][0]["args"]["api_keys"] = {"tenants_file": str(tenants)}
    cluster.deploy(config)
    details = wait_for(failed, 60, "DEPLOY_FAILED for the tenants file")
    assert f"{tenants}:7: tenant 'b': model 'gpt-9' is not one" in details["message"]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_keys_tenants_and_a_fuzzed_api(cluster, built_repository, tmp_path):
    """Two ingress replicas, the tenants' limits in a real Redis that both share."""
    import schemathesis

    redis = RedisServer().start()
    try:
        keyed_app(cluster, built_repository, tmp_path, redis, schemathesis)
    finally:
        redis.stop()


def keyed_app(cluster, built_repository, tmp_path, redis, schemathesis) -> None:

    keys = tmp_path / "keys"
    keys.write_text("key-for-tests\n")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    config = serve_config(
        built_repository,
        max_tokens_cap=8,
        default_max_tokens=4,
        deployment={"autoscaling_config": None},
    )
    args = config["applications"][0]["args"]
    args["api_keys"] = {"env": None, "file": str(keys), "tenants_file": str(tenants)}
    args["rate_limits"] = {"store": "redis", "redis_url": f"redis://{redis.address}/0"}
    args["ingress"] = {"num_replicas": 2}
    cluster.deploy(config)
    cluster.wait_running()
    anonymous = httpx.get(f"{cluster.url}/v1/models", timeout=30)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": "Bearer key-for-tests"}
    assert httpx.get(f"{cluster.url}/v1/models", headers=auth, timeout=30).status_code == 200

    # What a tenant stores, its keys read and no other key does (nor chains from, deletes).
    a1, a2, b1 = (bearer(key) for key in ("tenant-a-1", "tenant-a-2", "tenant-b-1"))
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4}
    stored = httpx.post(f"{cluster.url}/v1/responses", json=body, headers=a1, timeout=60)
    url = f"{cluster.url}/v1/responses/{stored.json()['id']}"
    chained = body | {"previous_response_id": stored.json()["id"]}
    for other in (b1, auth):
        assert httpx.get(url, headers=other, timeout=30).status_code == 404
        assert httpx.delete(url, headers=other, timeout=30).status_code == 404
        refused = httpx.post(f"{cluster.url}/v1/responses", json=chained, headers=other, timeout=60)
        assert refused.status_code == 404, refused.text
    assert httpx.get(url, headers=a2, timeout=30).json() == stored.json()

    # Tenant c's 20 requests a minute hold across both ingress replicas (one bucket in
    # Redis); a refill of one request takes 3 s, so a quick burst of 30 gets 20 or 21.
    c1 = bearer("tenant-c-1")
    burst = [httpx.get(f"{cluster.url}/v1/models", headers=c1, timeout=30) for _ in range(30)]
    statuses = Counter(r.status_code for r in burst)
    assert set(statuses) == {200, 429} and 20 <= statuses[200] <= 21, statuses
    refused = next(r for r in burst if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert burst[0].headers["x-ratelimit-limit-requests"] == "20"
    time.sleep(int(refused.headers["retry-after"]))
    assert httpx.get(f"{cluster.url}/v1/models", headers=c1, timeout=30).status_code == 200

    def tenant_c_counted() -> bool:  # both replicas' figures, once they have pushed them
        text = httpx.get(f"{cluster.url}/metrics", headers=auth, timeout=30).text
        counted = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "tritonllm_tenant_requests_total":
                    if sample.labels["tenant"] == "c":
                        counted[sample.labels["status"]] += sample.value
        return counted == {"200": statuses[200] + 1, "429": statuses[429]}

    wait_for(tenant_c_counted, 30, "tenant c's requests and 429s in /metrics")

    # Tenant d's 120 tokens a minute hold across both replicas: what its answers used
    # (the engine's prompt + answer counts) is the bucket and what refilled meanwhile,
    # within 10% (each request reserves 2 + 8 and settles what it used).
    d1 = bearer("tenant-d-1")
    body = {"model": MODEL, "prompt": "The cat", "max_tokens": 8, "ignore_eos": True}
    started, used, answers = time.monotonic(), 0, []
    for _ in range(24):
        answers.append(
            httpx.post(f"{cluster.url}/v1/completions", json=body, headers=d1, timeout=60)
        )
        if answers[-1].status_code == 200:
            used, ended = used + answers[-1].json()["usage"]["total_tokens"], time.monotonic()
    allowed = 120 + 2 * (ended - started)
    assert 0.9 * allowed <= used <= 1.1 * allowed, (
        used,
        allowed,
        Counter(a.status_code for a in answers),
    )
    refused = next(a for a in answers if a.status_code == 429)
    assert refused.json()["error"]["type"] == "tokens"
    assert answers[0].headers["x-ratelimit-limit-tokens"] == "120"
    time.sleep(int(refused.headers["retry-after"]))
    again = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=d1, timeout=60)
    assert again.status_code == 200, again.text
    used += again.json()["usage"]["total_tokens"]

    def tenant_d_counted() -> bool:  # the engines' counts, in both replicas' figures
        text = httpx.get(f"{cluster.url}/metrics", headers=auth, timeout=30).text
        samples = [
            sample
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels.get("tenant") == "d"
        ]
        tokens = sum(s.value for s in samples if s.name == "tritonllm_tenant_tokens_total")
        # Each answered request took a seat of the model's fair queue (a 429 none).
        seated = sum(
            s.value
            for s in samples
            if s.name == "tritonllm_tenant_queue_seconds_count" and s.labels["model"] == MODEL
        )
        answered = sum(a.status_code == 200 for a in answers) + 1
        return (tokens, seated) == (used, answered)

    wait_for(tenant_d_counted, 30, "tenant d's tokens in /metrics")

    # A key added to the tenants file lets its caller in, one removed no longer does.
    # (Within 10 s on every ingress replica: each reads the file every 2 s at most.)
    tenants.write_text(TENANTS.replace("tenant-a-2", "tenant-a-3"))

    def answers(headers: dict, status: int) -> bool:
        statuses = {httpx.get(models, headers=headers).status_code for _ in range(4)}
        return statuses == {status}

    models = f"{cluster.url}/v1/models"
    wait_for(lambda: answers(bearer("tenant-a-3"), 200), 10, "the added key let in")
    wait_for(lambda: answers(a2, 401), 10, "the removed key refused")

    schema = schemathesis.openapi.from_url(f"{cluster.url}/openapi.json")
    failures = server_errors(schema, lambda case: case.call(headers=auth, timeout=60), 15)
    assert not failures, failures[:5]
    assert httpx.get(f"{cluster.url}/v1/models", headers=auth, timeout=30).status_code == 200
