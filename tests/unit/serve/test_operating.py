"""Operating it on a cluster: replicas sized to the engine, the build Job and its claims,
upgrades of the RayService, the Serve config of the compose stack."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from serve import app
from serve.config import AppConfig, DeploymentOptions, ModelConfig
from tests import compose_render
from tests.conftest import ROOT
from tests.unit.serve.test_docker import ENV, HEAD_SCRIPT, stub_node, wait_for_line

KUBERAY = ROOT / "docker" / "kuberay"
GPU_DOCKERFILE = ROOT / "docker" / "Dockerfile.gpu"
PROJECT = "/workspace/triton-ray-llm"


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


# --- the build Job and its claims ----------------------------------------------------


def build_job() -> dict[tuple[str, str], dict]:
    return {
        (d["kind"], d["metadata"]["name"]): d
        for d in yaml.safe_load_all((KUBERAY / "build-job.yaml").read_text())
    }


def rayservice() -> dict:
    return next(
        d
        for d in yaml.safe_load_all((KUBERAY / "rayservice.yaml").read_text())
        if d["kind"] == "RayService"
    )


def image_trtllm_version() -> str:
    """TensorRT-LLM's version in the pinned NGC image, as docs and Dockerfile say it."""
    text = (ROOT / "README.md").read_text()
    return re.search(r"TensorRT-LLM (\d+\.\d+\.\d+), Python", text).group(1)


def job_pod() -> dict:
    return build_job()[("Job", "triton-ray-llm-engines")]["spec"]["template"]["spec"]


def test_every_claim_the_job_and_the_rayservice_use_is_created_with_its_storage_class():
    claims = {name: d for (kind, name), d in build_job().items() if kind == "PersistentVolumeClaim"}
    used = {
        v["persistentVolumeClaim"]["claimName"]
        for pod in (job_pod(), *serving_pods())
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert used == set(claims) == {"model-repository", "hf-checkpoint"}
    shared = claims["model-repository"]["spec"]
    # Every serving pod mounts it: ReadWriteMany, from a class that offers it (the
    # big clouds' default classes do not; the manifest names which ones do).
    assert shared["accessModes"] == ["ReadWriteMany"] and shared["storageClassName"]
    text = (KUBERAY / "build-job.yaml").read_text()
    for rwx_class in ("standard-rwx", "efs-sc", "azurefile-csi", "NFS"):
        assert rwx_class in text
    assert claims["hf-checkpoint"]["spec"]["accessModes"] == ["ReadWriteOnce"]


def serving_pods() -> list[dict]:
    cluster = rayservice()["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]
    ]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def expand(path: str, env: dict[str, str]) -> str:
    """A subPathExpr as the kubelet expands it: $(VAR) from the container's env."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], path)


def test_each_tensorrt_llm_version_has_its_folder_where_the_job_builds_and_the_pods_serve():
    version = image_trtllm_version()
    (init,) = job_pod()["initContainers"]
    (engines,) = job_pod()["containers"]
    assert env_of(init)["TRTLLM_VERSION"] == env_of(engines)["TRTLLM_VERSION"] == version
    # The Job's project folder on the claim is mounted over the image's project ...
    (project,) = [m for m in engines["volumeMounts"] if m["name"] == "repositories"]
    assert project["mountPath"] == PROJECT
    built = expand(project["subPathExpr"], env_of(engines))
    assert built == f"trtllm-{version}/project"
    # ... and filled from it by the init container (the claim at /claim there).
    assert f'cp -a {PROJECT}/. "/claim/trtllm-$TRTLLM_VERSION/project/"' in init["command"][-1]
    # The serving pods mount the repositories of that folder at the paths built into them.
    for pod in serving_pods():
        (container,) = pod["containers"]
        env = env_of(container)
        assert env["TRTLLM_VERSION"] == version
        mounts = {
            m["mountPath"]: m for m in container["volumeMounts"] if m["name"] == "repositories"
        }
        for repository in ("model_repository", "embedding_repository"):
            mount = mounts[f"{PROJECT}/{repository}"]
            assert expand(mount["subPathExpr"], env) == f"{built}/{repository}"


def test_the_job_stops_on_an_image_of_another_tensorrt_llm_version(tmp_path):
    script = job_pod()["containers"][0]["command"][-1]
    out = run_job_script(tmp_path, script, trtllm="1.3.0", gpus=1)
    assert out.returncode == 2
    assert "the image has TensorRT-LLM 1.3.0, the Job writes trtllm-1.2.1" in out.stderr


def test_the_job_takes_its_gpus_from_the_parallelism_and_stops_with_fewer(tmp_path):
    (engines,) = job_pod()["containers"]
    settings = yaml.safe_load((ROOT / "build_engines" / "trtllm.yaml").read_text())
    gpus = settings["tensor_parallel_size"] * settings["pipeline_parallel_size"]
    resources = engines["resources"]
    assert (
        resources["requests"]["nvidia.com/gpu"]
        == resources["limits"]["nvidia.com/gpu"]
        == str(gpus)
    )
    assert {"cpu", "memory"} <= set(resources["requests"])  # requests, not limits alone
    script = engines["command"][-1]
    four = tmp_path / "tp4"
    four.mkdir()
    (four / "build_engines").mkdir()
    (four / "build_engines" / "trtllm.yaml").write_text(
        "tensor_parallel_size: 2\npipeline_parallel_size: 2\n"
    )
    out = run_job_script(four, script, trtllm="1.2.1", gpus=2)
    assert out.returncode == 2
    assert "needs 4 GPUs, the Job has 2: set its nvidia.com/gpu to 4" in out.stderr
    out = run_job_script(four, script, trtllm="1.2.1", gpus=4)
    assert out.returncode == 0, out.stderr
    assert "make engines NO_VENV=1 TARGET=auto MODEL=/models/hf" in out.stdout
    assert (four / "tmp").is_dir()  # the scratch folder on the claim


def run_job_script(cwd: Path, script: str, trtllm: str, gpus: int) -> subprocess.CompletedProcess:
    """The Job's command with python3's tensorrt_llm, nvidia-smi and make stood in for."""
    bin_dir = cwd / "bin"
    bin_dir.mkdir(exist_ok=True)
    stubs = {
        "nvidia-smi": f"for i in $(seq {gpus}); do echo GPU $i; done",
        "make": 'echo "make $*"',
        # python3: the version for `import tensorrt_llm`, else the real one (yaml).
        "python3": f'case "$2" in *tensorrt_llm*) echo {trtllm};; *) exec {PYTHON} "$@";; esac',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    if not (cwd / "build_engines").exists():
        (cwd / "build_engines").symlink_to(ROOT / "build_engines")
    env = {**env_of(job_pod()["containers"][0]), "PATH": f"{bin_dir}:/usr/bin:/bin"}
    env["TMPDIR"] = str(cwd / "tmp")
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True)


PYTHON = __import__("sys").executable


def test_running_the_job_again_is_documented_and_cleans_up_after_itself():
    text = (KUBERAY / "build-job.yaml").read_text()
    assert "kubectl delete job triton-ray-llm-engines --ignore-not-found" in text
    job = build_job()[("Job", "triton-ray-llm-engines")]
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    docs = (ROOT / "docker" / "README.md").read_text()
    assert "kubectl delete job triton-ray-llm-engines --ignore-not-found" in docs


def test_the_rayservice_upgrades_to_a_new_cluster_and_says_how():
    spec = rayservice()["spec"]
    assert spec["upgradeStrategy"] == {"type": "NewCluster"}
    for text in (
        (KUBERAY / "rayservice.yaml").read_text(),
        (ROOT / "docker" / "README.md").read_text(),
    ):
        assert "NewCluster" in text and "TRTLLM_VERSION" in text


# --- the compose stack's Serve config ------------------------------------------------


def test_compose_serves_the_hosts_config_and_redeploys_it_without_a_rebuild(tmp_path):
    services = compose_render.render(ROOT / "docker" / "compose.yaml", ENV, ("worker",))["services"]
    head = services["ray-head"]
    (mount,) = [v for v in head["volumes"] if v["source"] == str(ROOT / "serve")]
    assert mount["read_only"] and mount["type"] == "bind"
    config = head["environment"]["SERVE_CONFIG"]
    assert config == f"{mount['target']}/config.yaml"
    # The head's first deploy and docker/serve-deploy.sh both adapt $SERVE_CONFIG.
    env = stub_node(tmp_path / "node") | {"SERVE_CONFIG": config}
    script = subprocess.Popen([str(HEAD_SCRIPT), "--gpus-per-replica", "1"], env=env)
    try:
        wait_for_line(tmp_path / "node" / "log", "serve deploy", script)
    finally:
        script.terminate()
        script.wait(10)
    redeploy = subprocess.run(
        [str(ROOT / "docker" / "serve-deploy.sh"), "--gpus-per-replica", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert redeploy.returncode == 0, redeploy.stderr
    log = (tmp_path / "node" / "log").read_text().splitlines()
    out = env["SERVE_CONFIG_OUT"]
    adapt = f"python3 -m serve.deploy_config --base {config} --gpus-per-replica 1 -o {out}"
    assert log.count(adapt) == 2, log
    assert log.count(f"python3 -m serve.launch --check-exposure {out}") == 2
    assert log.count(f"serve deploy {out}") == 2
    docs = (ROOT / "docker" / "README.md").read_text()
    assert "docker/serve-deploy.sh" in docs
