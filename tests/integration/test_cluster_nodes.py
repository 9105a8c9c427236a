"""Several Ray nodes on one machine: placement by resources, and a node that fails.

Each node is its own ``ray start`` (raylet, agents, workers), killable on its own. A
node started with ``--num-gpus=1`` stands in for a GPU node: Ray counts the GPU and
places GPU replicas there by the very options the GPU deployment ships (torch sees no
GPU, so the engine runs on CPU), which is what these tests check.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from serve.deploy_config import RAYSERVICE, deploy_config, load_base, spread_over_nodes
from tests.integration.cluster import BIN, RayCluster, RedisServer, serve_config
from tests.integration.test_production import (
    TRITON,
    Load,
    app_metrics,
    complete,
    metric_values,
    stream_events,
    wait_for,
)
from tests.soak_traffic import EMBEDDING_MODEL, Traffic

# quiet: a lost node's replica is back within a bound (60 s), which another part's
# replica starts beside it on two cores stretched past 110 s on a slow CI machine.
pytestmark = [pytest.mark.integration, pytest.mark.quiet]
EMBEDDINGS = f"Triton-{EMBEDDING_MODEL}"
LONG_STREAMS = 32  # in flight when a worker node is lost


def gpu_app_config(repository, embedding_repository, **llm_deployment) -> dict:
    """The shipped GPU deployment (``serve.deploy_config --gpus-per-replica 1``): each
    LLM replica reserves a GPU, the embeddings model stays on CPU. Its proxy is the
    head's alone here: the nodes of this test share one machine, so one port."""
    config = deploy_config(load_base(), gpus_per_replica=1)
    config["proxy_location"] = "HeadOnly"
    config["http_options"]["host"] = "127.0.0.1"
    llm, embeddings = config["applications"][0]["args"]["models"]
    llm["triton"]["model_repository"] = str(repository)
    llm["deployment"].update(llm_deployment)
    embeddings["triton"]["model_repository"] = str(embedding_repository)
    return config


def replica_nodes(cluster: RayCluster, deployment: str) -> list[str]:
    """The node name of each RUNNING replica of ``deployment`` ("dead": a dead node's)."""
    names = cluster.node_names()
    return [names.get(r["node_id"], "dead") for r in cluster.running_replicas("llm", deployment)]


def serve_status(cluster: RayCluster) -> str:
    result = subprocess.run(
        [str(BIN / "serve"), "status", "--address", cluster.dashboard],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def slow_start_warned_after_5s():
    """Serve names a replica waiting for resources in ``serve status`` after 30 s by
    default; 5 s here (RAY_SERVE_SLOW_STARTUP_WARNING_S, read by the controller)."""
    return {"RAY_SERVE_SLOW_STARTUP_WARNING_S": "5", "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S": "5"}


def test_gpu_replicas_go_to_gpu_nodes_and_a_second_waits_for_one(
    built_repository, built_embedding_repository, slow_start_warned_after_5s
):
    cluster = RayCluster(num_cpus=1, env=slow_start_warned_after_5s).start()
    try:
        cluster.add_node("cpu-1", num_cpus=2)
        cluster.add_node("gpu-1", num_cpus=2, num_gpus=1)
        scaling = {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 1,
            "upscale_delay_s": 1,
            "look_back_period_s": 2,
        }
        cluster.deploy(
            gpu_app_config(built_repository, built_embedding_repository, autoscaling_config=scaling)
        )
        cluster.wait_running()
        assert replica_nodes(cluster, TRITON) == ["gpu-1"]
        assert replica_nodes(cluster, EMBEDDINGS) != ["gpu-1"]

        with Load(cluster.url, clients=4, max_tokens=64) as load:
            # Autoscaling wants a second LLM replica; no node has a free GPU.
            def waiting_for_a_gpu():
                message = cluster.deployment("llm", TRITON)["message"]
                return "to be scheduled" in message and message

            message = wait_for(waiting_for_a_gpu, 120, "a replica waiting for a GPU")
            assert "'GPU': 1" in message or '"GPU": 1' in message, message
            assert "to be scheduled" in serve_status(cluster)
            assert len(cluster.running_replicas("llm", TRITON)) == 1

            joined = time.monotonic()
            cluster.add_node("gpu-2", num_cpus=2, num_gpus=1)
            wait_for(
                lambda: sorted(replica_nodes(cluster, TRITON)) == ["gpu-1", "gpu-2"],
                180,
                "the second replica running on the GPU node that joined",
            )
            started_s = time.monotonic() - joined
        statuses = {getattr(r, "status_code", r) for r in load.responses()}
        assert statuses == {200}, statuses
        answer = httpx.post(
            f"{cluster.url}/v1/embeddings",
            json={"model": "all-MiniLM-L6-v2", "input": "a cat"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        print(f"second replica running {started_s:.1f} s after its GPU node joined")
    finally:
        cluster.stop()


def test_a_lost_worker_node_is_replaced_while_the_app_keeps_serving(
    built_repository, built_embedding_repository
):
    cluster = RayCluster(num_cpus=1).start()
    try:
        # Room for the lost replica elsewhere: a third node (one LLM replica per node).
        # The "worker" resource keeps LLM replicas off the head, which has room for one.
        workers = [
            cluster.add_node(f"worker-{i}", num_cpus=2, resources={"worker": 1}) for i in (1, 2, 3)
        ]
        config = serve_config(
            built_repository,
            deployment={"autoscaling_config": None, "num_replicas": 2, "max_replicas_per_node": 1},
        )
        args = config["applications"][0]["args"]
        args["models"][0]["deployment"]["ray_actor_options"]["resources"] = {"worker": 0.01}
        embeddings = load_base()["applications"][0]["args"]["models"][1]
        embeddings["triton"]["model_repository"] = str(built_embedding_repository)
        args["models"].append(embeddings)
        # The ingress beside the head's proxy: a node's loss takes Triton replicas here,
        # not the front door (HeadOnly: every request enters through the head).
        args["ingress"]["ray_actor_options"]["resources"] = {"node:__internal_head__": 0.01}
        cluster.deploy(config)
        cluster.wait_running()
        placed = replica_nodes(cluster, TRITON)
        assert len(set(placed)) == 2, placed
        victim = next(node for node in workers if node.name == placed[0])

        clients = 2 * ["completion", "completion-stream", "embeddings"]
        with (
            ThreadPoolExecutor(LONG_STREAMS) as pool,
            Traffic(cluster.url, clients=clients) as traffic,
        ):
            # Long streams on both replicas when the node goes: those on its replica are
            # cut mid-answer and resume on the other (serve/migration.py).
            long_streams = [
                pool.submit(stream_events, cluster.url, max_tokens=200, min_tokens=200)
                for _ in range(LONG_STREAMS)
            ]
            time.sleep(5)
            killed_at = time.monotonic()
            victim.kill()

            def recovered():
                nodes = replica_nodes(cluster, TRITON)
                return len(nodes) == 2 and victim.name not in nodes and "dead" not in nodes

            wait_for(recovered, 180, "two LLM replicas running again")
            recovered_s = time.monotonic() - killed_at
            time.sleep(10)
            streams = [f.result(timeout=240) for f in long_streams]
            cut = [ended_with_error(events) for events in streams]
            migrations = app_metrics(cluster.url)
            hanging = traffic.stop()
        before = traffic.counts(until=killed_at)
        during = traffic.counts(since=killed_at, until=killed_at + recovered_s)
        after = traffic.counts(since=killed_at + recovered_s + 2)
        print(f"node lost: LLM back to 2 replicas in {recovered_s:.1f} s")
        print(f"before: {before}\nduring: {during}\nafter: {after}")
        print(f"long streams cut by the node's loss: {sum(cut)} of {len(cut)}")
        for events, was_cut in zip(streams, cut, strict=True):
            if was_cut:
                print(f"  {len(events) - 2} chunks, then {events[-2]}")
    finally:
        cluster.stop()
    assert hanging == 0
    assert all(set(statuses) == {"200"} for statuses in after.values()), after
    assert recovered_s < 60, recovered_s
    # Those on the lost replica resumed on the other one: every stream ran to its end.
    assert sum(cut) == 0, cut
    resumed = metric_values(migrations, "tritonllm_request_migrations_total", outcome="resumed")
    assert sum(value for _, value in resumed) >= 1  # the lost node was serving some
    # Whole requests in flight on the lost node were retried once elsewhere.
    lost = before.get("completion", Counter()) + during.get("completion", Counter())
    assert set(lost) <= {"200", "503"}, lost
    for counts in (before, during):  # none hung, nothing but these outcomes
        for kind, statuses in counts.items():
            assert set(statuses) <= {"200", "503", "stream-error"}, (kind, statuses)


def ended_with_error(events: list) -> bool:
    """True for a stream cut by an error event, False for one run to its end."""
    assert events[-1] == "[DONE]", events[-3:]
    if "error" in events[-2]:
        return True
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
    return False


def test_without_the_head_a_worker_keeps_serving_and_stays_ready(built_repository):
    """The head's GCS and Serve's controller fail (GCS fault tolerance on Redis, as the
    RayService runs it): the worker's own proxy keeps answering and the readiness check
    the RayService's worker probe runs stays ready, since neither needs the head; once
    the GCS is back (it restarts the controller), ``serve deploy`` of a changed config
    takes effect. The config is the RayService's (``spread_over_nodes``) with a head of
    no CPUs, one worker here: one ingress replica, so one LLM replica."""
    probe = worker_readiness_probe()
    redis = RedisServer().start()
    # On loopback: the worker's HAProxy reaches the ingress replica at the node's address.
    redis_env = {"RAY_REDIS_ADDRESS": redis.address}
    mode = os.environ.get("CLUSTER_SERVE_MODE", "throughput")  # "default": Serve's own proxy
    cluster = RayCluster(num_cpus=0, env=redis_env, node_ip="127.0.0.2", mode=mode).start()
    try:
        # KubeRay sets this on worker pods under GCS fault tolerance (Ray's default, 60 s,
        # would end a worker whose head is down a minute); the head's raylet keeps 60 s.
        worker_env = {"RAY_gcs_rpc_server_reconnect_timeout_s": "600"}
        worker = cluster.add_node("worker-1", num_cpus=2, own_proxy=True, env=worker_env)

        def rayservice_config(**model_fields) -> dict:
            fixed = {"autoscaling_config": None, "num_replicas": 1}
            config = spread_over_nodes(
                serve_config(built_repository, deployment=fixed, **model_fields)
            )
            config["proxy_location"] = "EveryNode"
            config["applications"][0]["args"]["ingress"]["num_replicas"] = 1  # one worker
            config["applications"][0]["args"]["models"][0]["deployment"]["num_replicas"] = 1
            return config

        cluster.deploy(rayservice_config())
        cluster.wait_running()
        # Nothing of the app on the head: every replica on the worker.
        for deployment in cluster.applications()["llm"]["deployments"]:
            assert replica_nodes(cluster, deployment) == ["worker-1"], deployment
        probe_url = f"{worker.url}{probe['path']}"
        wait_for(lambda: ready(probe_url), 60, "the worker's readiness check passing")
        clients = 2 * ["completion", "completion-stream"]
        with (
            Traffic(worker.url, clients=clients) as traffic,
            Poller(probe_url) as readiness,
            Poller(f"{worker.url}/health") as app_health,  # for the record: it asks the head
        ):
            time.sleep(3)
            killed_at = time.monotonic()
            cluster.kill_gcs()
            cluster.kill_serve_controller()

            # A fixed outage, well within the 60 s after which the head's own raylet,
            # without its GCS, exits (and with it any deploy): a slower machine sends
            # fewer requests in it rather than stretching it.
            time.sleep(GCS_OUTAGE_S)
            restarted_at = time.monotonic()
            print(f"GCS restarted after {restarted_at - killed_at:.1f} s")
            cluster.restart_gcs()
            capped = rayservice_config(max_tokens_cap=100)
            wait_for(lambda: deployed(cluster, capped), 120, "serve deploy accepted again")
            deployable_s = time.monotonic() - restarted_at
            wait_for(
                lambda: complete(worker.url, max_tokens=150).status_code == 400,
                120,
                "the new max_tokens cap in force through the worker's proxy",
            )
            updated_s = time.monotonic() - restarted_at
            time.sleep(3)
            hanging = traffic.stop()
        outage = traffic.counts(since=killed_at, until=restarted_at)
        after = traffic.counts(since=restarted_at)
        checks = readiness.statuses(since=killed_at, until=restarted_at)
        app_checks = app_health.statuses(since=killed_at, until=restarted_at)
        print(f"head's GCS and controller down {restarted_at - killed_at:.1f} s")
        print(f"requests through the worker's proxy meanwhile: {outage}; after: {after}")
        print(f"worker readiness checks meanwhile: {checks}; the app's /health: {app_checks}")
        print(
            f"serve deploy accepted {deployable_s:.1f} s after the GCS restarted, "
            f"the new config in force after {updated_s:.1f} s"
        )
    finally:
        cluster.stop()
        redis.stop()
    assert hanging == 0
    assert set(outage) == {"completion", "completion-stream"}, outage
    assert all(set(statuses) == {"200"} for statuses in outage.values()), outage
    assert sum(sum(c.values()) for c in outage.values()) >= 15, outage
    assert set(checks) == {200} and sum(checks.values()) >= GCS_OUTAGE_S / 2, checks
    assert updated_s < 90, updated_s


def worker_readiness_probe() -> dict:
    """The readiness probe of the RayService's worker pods (an HTTP GET on Serve's port)."""
    manifest = next(yaml.safe_load_all(RAYSERVICE.read_text()))
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    probe = container["readinessProbe"]["httpGet"]
    assert probe["port"] == served["http_options"]["port"], probe  # the node's proxy
    return probe


def ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


class Poller:
    """GETs ``url`` once a second from a thread, as a kubelet's probe does; each answer's
    status (or the error's name) kept with its time."""

    def __init__(self, url: str):
        self.url, self.answers = url, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(1):
            sent = time.monotonic()
            try:
                status = httpx.get(self.url, timeout=5).status_code
            except httpx.HTTPError as error:
                status = type(error).__name__
            self.answers.append((sent, status))

    def statuses(self, since: float, until: float) -> Counter:
        return Counter(status for sent, status in self.answers if since <= sent < until)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


GCS_OUTAGE_S = 30


def deployed(cluster: RayCluster, config: dict) -> bool:
    """One try of ``serve deploy``, short: a try sent while the dashboard has not yet
    found the restarted GCS can hang, and must not take the whole wait with it. A try
    that fails prints why, with the time, for the report of a wait that runs out."""
    try:
        cluster.deploy(config, timeout_s=20)
    except (AssertionError, subprocess.TimeoutExpired) as error:
        print(f"{time.strftime('%H:%M:%S')} serve deploy refused: {str(error)[-600:]}")
        return False
    return True
