"""docker/kuberay/: the RayService and the build Job against serve/config.yaml and the GPU image."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve.app import COLLECTOR_OPTIONS, RESPONSE_STORE_OPTIONS, ingress_options
from serve.config import AppConfig, ResponsesConfig
from serve.deploy_config import (
    KUBERAY_RESPONSES_REDIS_URL_ENV,
    deploy_config,
    load_base,
    main,
    spread_over_nodes,
    update_rayservice,
)
from tests.conftest import ROOT
from tests.unit.serve.test_docker import compose, image_ray_version, served_repositories

MANIFEST = ROOT / "docker" / "kuberay" / "rayservice.yaml"
BUILD_JOB = ROOT / "docker" / "kuberay" / "build-job.yaml"
REDIS = ROOT / "docker" / "kuberay" / "redis.yaml"
API_KEYS_SECRET = "triton-ray-llm-api-keys"


@pytest.fixture(scope="module")
def docs() -> dict:
    manifests = [
        *yaml.safe_load_all(MANIFEST.read_text()),
        *yaml.safe_load_all(BUILD_JOB.read_text()),
    ]
    return {d["kind"]: d for d in manifests}


def pods(docs) -> dict[str, dict]:
    cluster = docs["RayService"]["spec"]["rayClusterConfig"]
    specs = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    for group in cluster["workerGroupSpecs"]:
        specs[group["groupName"]] = group["template"]["spec"]
    specs["build-job"] = docs["Job"]["spec"]["template"]["spec"]
    return specs


def serving_pods(docs) -> dict[str, dict]:
    """The head and the worker groups: the pods Serve's replicas may run in."""
    return {name: pod for name, pod in pods(docs).items() if name != "build-job"}


def cluster_config(gpus_per_replica: float = 1) -> dict:
    """What serveConfigV2 should be: serve/config.yaml as `--update-rayservice` adapts it."""
    return deploy_config(
        load_base(),
        gpus_per_replica,
        responses_redis_url_env=KUBERAY_RESPONSES_REDIS_URL_ENV,
        spread=True,
    )


def claim_mounts(pod: dict) -> dict[str, tuple[str, str]]:
    """mountPath -> (claim, subPath) of the pod's persistent volume claims, a
    subPathExpr expanded with the container's environment ($(VAR), as the kubelet does)."""
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    claims = {
        v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]
    }
    return {
        m["mountPath"]: (
            claims[m["name"]],
            re.sub(r"\$\((\w+)\)", lambda v: env[v[1]], m.get("subPathExpr", m.get("subPath", ""))),
        )
        for m in container["volumeMounts"]
        if claims.get(m["name"])
    }


def test_serve_config_v2_is_serve_config_yaml_for_a_gpu_cluster(docs):
    served = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    assert served == cluster_config(gpus_per_replica=1), (
        "serveConfigV2 drifted from serve/config.yaml: "
        "run `python -m serve.deploy_config --update-rayservice`"
    )
    ServeDeploySchema.model_validate(served)
    for app in served["applications"]:
        AppConfig.model_validate(app["args"])  # the app's own schema, responses included


def test_update_rewrites_only_the_serve_config(tmp_path):
    manifest = tmp_path / "rayservice.yaml"
    manifest.write_text(MANIFEST.read_text())
    assert not update_rayservice(manifest, cluster_config(1))  # current
    two_gpus = cluster_config(2)
    assert update_rayservice(manifest, two_gpus)
    before = list(yaml.safe_load_all(MANIFEST.read_text()))
    after = list(yaml.safe_load_all(manifest.read_text()))
    assert yaml.safe_load(after[0]["spec"].pop("serveConfigV2")) == two_gpus
    before[0]["spec"].pop("serveConfigV2")
    assert after == before


def test_responses_redis_url_env_stores_every_apps_responses_in_redis():
    base = load_base()
    base["applications"][0]["args"]["responses"] = {"redis_url": "redis://x:6379/0", "ttl_s": 60}
    config = deploy_config(base, 1, responses_redis_url_env="URL_VAR")
    responses = config["applications"][0]["args"]["responses"]
    # The base's other fields stay; its URL gives way to the variable (exactly one).
    assert responses == {"ttl_s": 60, "store": "redis", "redis_url_env": "URL_VAR"}
    assert AppConfig.model_validate(config["applications"][0]["args"]).responses == (
        ResponsesConfig(store="redis", redis_url_env="URL_VAR", ttl_s=60)
    )
    assert base["applications"][0]["args"]["responses"]["redis_url"]  # base untouched
    without = deploy_config(load_base(), 1)["applications"][0]["args"]
    assert without.get("responses") == load_base()["applications"][0]["args"].get("responses")


def test_responses_redis_url_env_flag(tmp_path):
    out = tmp_path / "serve.yaml"
    assert main(["--responses-redis-url-env", "URL_VAR", "-o", str(out)]) == 0
    config = yaml.safe_load(out.read_text())
    assert config == deploy_config(load_base(), 1, responses_redis_url_env="URL_VAR")


def test_stored_responses_go_to_the_gcs_redis_in_database_1(docs):
    served = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    gcs = docs["RayService"]["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    for app in served["applications"]:
        responses = AppConfig.model_validate(app["args"]).responses
        assert responses.store == "redis" and responses.redis_url_env
        for name, pod in serving_pods(docs).items():
            (container,) = pod["containers"]
            names = [e["name"] for e in container["env"]]
            env = {e["name"]: e for e in container["env"]}
            url = urlsplit(env[responses.redis_url_env]["value"])
            password = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert password == gcs["redisPassword"]["valueFrom"]["secretKeyRef"], name
            assert url.password == "$(REDIS_PASSWORD)", name
            # Kubernetes expands $(VAR) only of variables defined earlier in the list.
            assert names.index("REDIS_PASSWORD") < names.index(responses.redis_url_env), name
            assert url.netloc.split("@")[1] == gcs["redisAddress"], name
            # Ray's GCS keeps its keys in database 0; the responses stay out of it.
            assert url.scheme == "redis" and int(url.path.lstrip("/")) != 0, name


def test_cluster_runs_the_gpu_image_and_the_tested_ray(docs):
    cluster = docs["RayService"]["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == image_ray_version()
    head = cluster["headGroupSpec"]
    image = compose()["services"]["ray-head"]["image"]
    for name, pod in pods(docs).items():
        (container,) = pod["containers"]
        assert container["image"] == image, name
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


def test_every_pod_mounts_every_repository_the_serve_config_names(docs):
    claim = "model-repository"
    for name, pod in serving_pods(docs).items():
        mounts = claim_mounts(pod)
        for path in served_repositories():  # where the build Job wrote (test_operating.py)
            version = re.search(r"trtllm-[0-9.]+/project", mounts[path][1]).group(0)
            assert mounts.get(path) == (claim, f"{version}/{path.rsplit('/', 1)[1]}"), (name, path)


def test_build_job_builds_in_the_projects_copy_on_the_claim(docs):
    pod = docs["Job"]["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"][-1]
    assert command.rstrip().endswith("make engines NO_VENV=1 TARGET=auto MODEL=/models/hf")
    # The repositories' tracked layout comes with the project's copy (the image's own
    # project, templates and model.py adapters included).
    assert "cp -a /workspace/triton-ray-llm/." in pod["initContainers"][0]["command"][-1]
    assert claim_mounts(pod)["/workspace/triton-ray-llm"][0] == "model-repository"


def test_autoscaling_adds_gpu_workers_up_to_the_llm_replicas(docs):
    cluster = docs["RayService"]["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    served = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    low = high = 0.0
    for model in served["applications"][0]["args"]["models"]:
        deployment = model["deployment"]
        gpus = deployment["ray_actor_options"].get("num_gpus", 0)
        scaling = deployment.get("autoscaling_config") or {}
        fixed = deployment.get("num_replicas")
        low += gpus * (fixed or scaling.get("min_replicas", 1))
        high += gpus * (fixed or scaling.get("max_replicas", 1))
    (group,) = cluster["workerGroupSpecs"]
    per_worker = int(
        group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    )
    assert group["minReplicas"] == low / per_worker and group["maxReplicas"] == high / per_worker
    assert "gcsFaultToleranceOptions" in MANIFEST.read_text()  # the Redis option, documented
    assert "redisAddress" in MANIFEST.read_text()


def test_serving_pods_read_api_keys_from_the_secret(docs):
    for name, pod in serving_pods(docs).items():
        (container,) = pod["containers"]
        env = {e["name"]: e for e in container.get("env", [])}
        ref = env["TRITONLLM_API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": API_KEYS_SECRET, "key": "keys"}, name
        assert not ref.get("optional")  # no Secret, no pod: the Ingress is public
    assert f"kubectl create secret generic {API_KEYS_SECRET} --from-literal=keys=" in (
        MANIFEST.read_text()
    )


def test_workers_are_ready_on_their_own_proxys_health_and_the_head_keeps_kuberays_probes(docs):
    # Serve's per-node /-/healthz, which the node's HAProxy answers from its own checks
    # of the ingress replicas; the app-wide /health asks the controller in the head.
    # tests/integration/test_cluster_nodes.py runs this probe with the head's GCS and
    # controller killed.
    served = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    cluster = docs["RayService"]["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        probe = container["readinessProbe"]["httpGet"]
        assert probe == {"path": "/-/healthz", "port": served["http_options"]["port"]}
    # A head that fails readiness leaves the head Service the workers and the
    # operator use, and Serve is only deployed once the head is ready.
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert "readinessProbe" not in head


def test_the_gcs_keeps_its_state_in_the_redis_that_redis_yaml_runs(docs):
    redis = {d["kind"]: d for d in yaml.safe_load_all(REDIS.read_text())}
    options = docs["RayService"]["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    host, port = options["redisAddress"].split(":")
    service = redis["Service"]
    assert host == service["metadata"]["name"]
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    pod = redis["Deployment"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # The password Ray sends is the one Redis requires.
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == env["REDIS_PASSWORD"]
    assert '--requirepass "$REDIS_PASSWORD"' in container["args"][0]
    assert "--appendonly yes" in container["args"][0]  # survives its own restart


def test_no_replica_of_the_app_lands_on_the_head(docs):
    head = docs["RayService"]["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert head["num-cpus"] == "0" and head["num-gpus"] == "0"
    # A replica that asks for no CPU (nor GPU) fits on a head of none too: each asks.
    served = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    for app in served["applications"]:
        config = AppConfig.model_validate(app["args"])
        assert ingress_options(config)["ray_actor_options"]["num_cpus"] > 0
        for model in config.models:
            assert model.deployment.ray_actor_options.num_cpus > 0, model.id
    for internal in (COLLECTOR_OPTIONS, RESPONSE_STORE_OPTIONS):
        assert internal["ray_actor_options"]["num_cpus"] > 0, internal["name"]


def test_ingress_and_llm_replicas_are_spread_over_the_workers(docs):
    served = yaml.safe_load(docs["RayService"]["spec"]["serveConfigV2"])
    (group,) = docs["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for app in served["applications"]:
        config = AppConfig.model_validate(app["args"])
        ingress = ingress_options(config)  # what Serve gets
        assert ingress["num_replicas"] >= 2 and ingress["max_replicas_per_node"] == 1
        # One ingress replica per worker and none on the head: enough workers for all.
        assert group["minReplicas"] >= ingress["num_replicas"]
        for model in config.models:
            if model.task != "generate":
                continue
            assert model.deployment.max_replicas_per_node == 1, model.id
            scaling = model.deployment.autoscaling_config
            fewest = model.deployment.num_replicas or scaling.min_replicas
            assert fewest >= 2, model.id


def test_spread_over_nodes_raises_replica_counts_and_keeps_larger_ones():
    base = load_base()
    models = base["applications"][0]["args"]["models"]
    models[0]["deployment"]["autoscaling_config"] = {"min_replicas": 3, "max_replicas": 5}
    fixed = {**models[0], "id": "fixed", "deployment": {"num_replicas": 1}}
    unset = {**models[0], "id": "unset", "deployment": {}}
    models += [fixed, unset]
    args = spread_over_nodes(base)["applications"][0]["args"]
    llm, embeddings, fixed, unset = args["models"]
    assert llm["deployment"]["autoscaling_config"] == {"min_replicas": 3, "max_replicas": 5}
    assert fixed["deployment"]["num_replicas"] == unset["deployment"]["num_replicas"] == 2
    for model in (llm, fixed, unset):
        assert model["deployment"]["max_replicas_per_node"] == 1
    assert "max_replicas_per_node" not in embeddings["deployment"]  # one CPU replica
    assert args["ingress"]["num_replicas"] == 2 and args["ingress"]["max_replicas_per_node"] == 1
    AppConfig.model_validate(args)
    # The compose config (one node) is not spread: a second replica would never start.
    single = deploy_config(load_base(), 1)["applications"][0]["args"]
    assert "max_replicas_per_node" not in single["ingress"]
    assert ingress_options(AppConfig.model_validate(single))["num_replicas"] == 1


def test_spread_over_nodes_flag(tmp_path):
    out = tmp_path / "serve.yaml"
    assert main(["--spread-over-nodes", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == deploy_config(load_base(), 1, spread=True)
