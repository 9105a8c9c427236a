"""What the stack exposes: no open API beyond loopback unless asked for, and HAProxy's
stats and Prometheus ports on the API's interface, not on every one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serve.engines.triton.launcher import free_port
from serve.launch import OPEN_API_ENV, is_loopback, open_api_refusal
from tests.conftest import ROOT
from tests.processes import listeners
from tests.unit.serve.engines.triton.test_install import _alive, start_haproxy

CONFIG = ROOT / "serve" / "config.yaml"


def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m serve.launch`` with only ``env`` of the key variables set."""
    base = {k: v for k, v in os.environ.items() if k not in ("TRITONLLM_API_KEYS", OPEN_API_ENV)}
    command = [sys.executable, "-m", "serve.launch", *args]
    return subprocess.run(
        command, env=base | env, capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_beyond_loopback_without_keys_it_refuses_and_says_how_to_set_keys_or_opt_in():
    refused = launch("--host", "0.0.0.0", str(CONFIG))
    assert refused.returncode == 2, refused
    assert "refusing to serve an API without keys on 0.0.0.0" in refused.stderr
    assert "export TRITONLLM_API_KEYS=" in refused.stderr  # how to set keys
    assert "OPEN_API=1" in refused.stderr and "--allow-open-api" in refused.stderr
    assert "Serving on" not in refused.stdout  # nothing started


@pytest.mark.parametrize(
    "args, env",
    [
        (("--host", "0.0.0.0"), {"TRITONLLM_API_KEYS": "k1,k2"}),
        (("--host", "0.0.0.0", "--allow-open-api"), {}),
        (("--host", "0.0.0.0"), {OPEN_API_ENV: "1"}),
        ((), {}),  # the config's own host: 127.0.0.1
        (("--host", "127.0.0.2"), {}),
        (("--host", "::1"), {}),
    ],
)
def test_keys_an_explicit_opt_in_or_loopback_let_it_start(args, env):
    allowed = launch(*args, "--check-exposure", str(CONFIG), **env)
    assert allowed.returncode == 0, allowed.stderr


def test_a_key_file_counts_and_an_empty_or_missing_one_does_not(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITONLLM_API_KEYS", raising=False)
    monkeypatch.delenv(OPEN_API_ENV, raising=False)
    keys = tmp_path / "keys"
    app = {"name": "llm", "args": {"api_keys": {"env": None, "file": str(keys)}}}
    config = {"http_options": {"host": "10.1.2.3"}, "applications": [app]}
    assert "application llm" in open_api_refusal(config, False)  # missing
    keys.write_text("# none yet\n")
    assert open_api_refusal(config, False) is not None
    keys.write_text("k1\n")
    assert open_api_refusal(config, False) is None
    assert not is_loopback("example.org") and is_loopback("localhost")


def test_make_run_passes_the_opt_in_only_when_asked():
    def dry(*args: str) -> str:
        return subprocess.run(
            ["make", "-n", "run", "NO_VENV=1", *args], capture_output=True, text=True, cwd=ROOT
        ).stdout

    assert "--allow-open-api" in dry("HOST=0.0.0.0", "OPEN_API=1")
    assert "--allow-open-api" not in dry("HOST=0.0.0.0")


def haproxy_config(api: str, stats: int, metrics: int) -> str:
    """The binds of Ray Serve's HAProxy template (ray/serve/_private/haproxy_templates.py)."""
    return (
        "defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n  timeout server 1s\n"
        f"frontend prometheus\n    bind :{metrics}\n    mode http\n"
        f"frontend http_frontend\n    bind {api}\n"
        f"listen stats\n  bind *:{stats}\n  stats enable\n  stats uri /stats\n"
    )


def run_haproxy(config: Path, ports: list[int]) -> set[tuple[str, int]]:
    """HAProxy through the wrapper, as Ray starts it; its listeners once all are up."""
    starter, haproxy = start_haproxy(config)
    try:
        deadline = time.monotonic() + 10
        while len(held := listeners(haproxy)) < len(ports):
            assert time.monotonic() < deadline, held
            time.sleep(0.05)
        return held
    finally:
        starter.kill()
        starter.wait()
        if _alive(haproxy):
            os.kill(haproxy, 9)


def test_haproxy_stats_and_metrics_listen_on_the_apis_host_only(tmp_path):
    api, stats, metrics = free_port(), free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(f"127.0.0.1:{api}", stats, metrics))
    held = run_haproxy(config, [api, stats, metrics])
    assert held == {("127.0.0.1", api), ("127.0.0.1", stats), ("127.0.0.1", metrics)}
    # Rewritten in place: Ray finds its HAProxy by this path on the command line.
    assert re.search(rf"listen stats\n  bind 127\.0\.0\.1:{stats}\n", config.read_text())


def test_an_api_on_every_interface_keeps_haproxys_wildcard_binds(tmp_path):
    api, stats, metrics = free_port(), free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(f"*:{api}", stats, metrics))
    held = run_haproxy(config, [api, stats, metrics])
    assert {port for _, port in held} == {api, stats, metrics}
    assert all(host in ("0.0.0.0", "0000:" * 7 + "0000") for host, _ in held), held
