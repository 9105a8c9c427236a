"""Operating it on a cluster: replicas sized to the engine."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from serve import app
from serve.config import AppConfig, DeploymentOptions, ModelConfig
from tests.conftest import ROOT

# --- max_ongoing_requests against the batch and the autoscaling target -------------


@pytest.fixture
def batch(monkeypatch):
    """The engine's batch size the app reads from a repository, set by the test."""
    size = {"value": 64}
    monkeypatch.setattr(app.repository, "engine_batch_size", lambda *_: size["value"])
    return size


def model(**deployment) -> ModelConfig:
    return ModelConfig(id="m", deployment=deployment)


def test_unset_max_ongoing_is_twice_the_target_a_full_batch_and_one_waiting(batch):
    scaling = {"min_replicas": 1, "max_replicas": 4}
    assert app.autoscaling(model(autoscaling_config=scaling)).target_ongoing_requests == 64
    assert app.max_ongoing_requests(model(autoscaling_config=scaling)) == 128
    assert app.max_ongoing_requests(model()) == 128  # no autoscaling_config: 1 to 1
    assert app.max_ongoing_requests(model(num_replicas=2)) == 128
    batch["value"] = 8  # the torch engine's
    assert app.max_ongoing_requests(model(autoscaling_config=scaling)) == 16
    given = scaling | {"target_ongoing_requests": 24}
    assert app.autoscaling(model(autoscaling_config=given)).target_ongoing_requests == 24
    assert app.max_ongoing_requests(model(autoscaling_config=given)) == 48


def test_serves_default_target_of_2_is_not_taken_for_one_the_config_set(batch):
    # Serve's AutoscalingConfig always holds a target (2 by default): a config that
    # sets none gets the engine's batch size, not 2.
    scaling = DeploymentOptions(autoscaling_config={"min_replicas": 1}).autoscaling_config
    assert scaling.target_ongoing_requests == 2
    assert (
        app.autoscaling(model(autoscaling_config={"min_replicas": 1})).target_ongoing_requests == 64
    )


def test_max_ongoing_below_the_target_is_an_error_that_says_what_to_set(batch):
    with pytest.raises(
        ValueError, match=r"max_ongoing_requests 32 is below its autoscaling target of 64"
    ):
        app.max_ongoing_requests(
            model(autoscaling_config={"max_replicas": 2}, max_ongoing_requests=32)
        )
    with pytest.raises(ValidationError, match="below autoscaling_config.target_ongoing_requests 8"):
        DeploymentOptions(autoscaling_config={"target_ongoing_requests": 8}, max_ongoing_requests=4)
    # A fixed replica count has no target: fewer than a batch is a choice (tests use 2).
    assert app.max_ongoing_requests(model(num_replicas=1, max_ongoing_requests=2)) == 2
    ok = model(autoscaling_config={"max_replicas": 2}, max_ongoing_requests=64)
    assert app.max_ongoing_requests(ok) == 64


def shipped_llm(config: dict) -> ModelConfig:
    args = AppConfig.model_validate(config["applications"][0]["args"])
    return next(m for m in args.models if m.task == "generate")


@pytest.mark.parametrize("source", ["serve/config.yaml", "docker/kuberay/rayservice.yaml"])
def test_shipped_configs_fill_a_batch_and_scale_before_shedding(batch, source):
    text = (ROOT / source).read_text()
    if source.endswith("rayservice.yaml"):
        text = yaml.safe_load(text.split("\n---")[0])["spec"]["serveConfigV2"]
    llm = shipped_llm(yaml.safe_load(text))
    for size in (8, 64, 256):  # the torch engine's, TensorRT-LLM's default, a larger build
        batch["value"] = size
        target = app.autoscaling(llm).target_ongoing_requests
        assert target == size  # a replica scales out once its batch is full
        assert app.max_ongoing_requests(llm) >= 2 * target  # and takes more meanwhile
    assert llm.deployment.max_queued_requests > 0
