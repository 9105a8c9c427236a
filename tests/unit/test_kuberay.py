"""docker/kuberay/rayservice.yaml against serve/config.yaml and the GPU image."""

from __future__ import annotations

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve.deploy_config import deploy_config, load_base, update_rayservice
from tests.conftest import ROOT
from tests.unit.test_docker import REPOSITORY_MOUNT, compose, image_ray_version

MANIFEST = ROOT / "docker" / "kuberay" / "rayservice.yaml"


@pytest.fixture(scope="module")
def docs() -> dict:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_serve_config_v2_is_serve_config_yaml_for_a_gpu_cluster(docs):
    served = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    assert served == deploy_config(load_base(), gpus_per_replica=1), (
        "serveConfigV2 drifted from serve/config.yaml: "
        "run `python -m serve.deploy_config --update-rayservice`"
    )
    ServeDeploySchema.model_validate(served)


def test_update_rewrites_only_the_serve_config(tmp_path):
    manifest = tmp_path / "rayservice.yaml"
    manifest.write_text(MANIFEST.read_text())
    assert not update_rayservice(manifest, deploy_config(load_base(), 1))  # current
    two_gpus = deploy_config(load_base(), 2)
    assert update_rayservice(manifest, two_gpus)
    before = list(yaml.safe_load_all(MANIFEST.read_text()))
    after = list(yaml.safe_load_all(manifest.read_text()))
    assert yaml.safe_load(after[1]["spec"].pop("serveConfigV2")) == two_gpus
    before[1]["spec"].pop("serveConfigV2")
    assert after == before


def test_cluster_runs_the_gpu_image_and_the_tested_ray(docs):
    cluster = docs["RayService"]["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == image_ray_version()
    head = cluster["headGroupSpec"]
    workers = cluster["workerGroupSpecs"]
    image = compose()["services"]["ray-head"]["image"]
    pods = [head["template"]["spec"], *(w["template"]["spec"] for w in workers)]
    for pod in pods:
        (container,) = pod["containers"]
        assert container["image"] == image
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        claims = {v["name"]: v.get("persistentVolumeClaim", {}) for v in pod["volumes"]}
        repository = claims[mounts[REPOSITORY_MOUNT]]["claimName"]
        assert repository == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert head["rayStartParams"]["num-gpus"] == "0"  # replicas land on GPU workers
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {6379, 8265, 8000} <= ports


def test_gpu_workers_hold_what_a_replica_asks(docs):
    served = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    models = served["applications"][0]["args"]["models"]
    wanted = max(m["deployment"]["ray_actor_options"].get("num_gpus", 0) for m in models)
    assert wanted >= 1
    for group in docs["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= wanted
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_ingress_reaches_serve_port_8000(docs):
    served = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    (rule,) = docs["Ingress"]["spec"]["rules"]
    backend = rule["http"]["paths"][0]["backend"]["service"]
    # KubeRay's Service for Serve is named after the RayService.
    assert backend["name"] == docs["RayService"]["metadata"]["name"] + "-serve-svc"
    assert backend["port"]["number"] == served["http_options"]["port"] == 8000
