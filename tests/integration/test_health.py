"""GET /health on a real cluster: 503 naming a model that has no ready replica, 200 once
every model has one (what the compose healthcheck and KubeRay's probes ask)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.cluster import app_config

pytestmark = pytest.mark.integration
MODEL = "tritonllm-default"


def model(model_id: str, repository, **actor) -> dict:
    return {
        "id": model_id,
        "triton": {"model_repository": str(repository)},
        "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5, **actor}},
    }


def health(url: str, timeout_s: float = 240) -> httpx.Response:
    """The first answer of the app's /health (the ingress is up), or a failure."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/health", timeout=30)
            # Before the app's route exists the proxy answers 404 (or 503 without our body).
            if response.status_code == 200 or '"model_not_ready"' in response.text:
                return response
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"no /health answer after {timeout_s} s")


def test_health_names_the_model_without_a_ready_replica_until_every_model_has_one(
    cluster, built_repository
):
    # "waiting" asks for a resource no node has: its replica never starts.
    stuck = model("waiting", built_repository, resources={"no-such-resource": 1})
    cluster.deploy(app_config([model(MODEL, built_repository), stuck]))
    deadline = time.monotonic() + 240
    while True:  # until the LLM's own replica is up, only "waiting" is named
        response = health(cluster.url)
        # A 200 is the app the shared cluster ran before, until the new ingress replaces it.
        error = response.json().get("error", {"message": response.text})
        if "waiting" in error["message"] and MODEL not in error["message"]:
            break
        assert time.monotonic() < deadline, error
        time.sleep(2)
    assert response.status_code == 503 and error["code"] == "model_not_ready"
    assert response.headers["retry-after"] == "5"

    cluster.deploy(app_config([model(MODEL, built_repository)]))
    cluster.wait_running()
    response = health(cluster.url)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ready", "models": [MODEL]}
