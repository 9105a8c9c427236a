"""Several Ray nodes on one machine: placement by resources, and a node that fails.

Each node is its own ``ray start`` (raylet, agents, workers), killable on its own. A
node started with ``--num-gpus=1`` stands in for a GPU node: Ray counts the GPU and
places GPU replicas there by the very options the GPU deployment ships (torch sees no
GPU, so the engine runs on CPU), which is what these tests check.
"""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from serve.deploy_config import deploy_config, load_base
from tests.integration.cluster import BIN, RayCluster
from tests.integration.test_production import TRITON, Load, wait_for

pytestmark = pytest.mark.integration
EMBEDDINGS = "Triton-all-MiniLM-L6-v2"


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
    """The node name of each RUNNING replica of ``deployment``."""
    names = cluster.node_names()
    return [names[r["node_id"]] for r in cluster.running_replicas("llm", deployment)]


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
