"""Two stacks on one machine (two `make run`s, a test beside a benchmark) each answer
only their own clients, also while one of them is still starting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from serve.engines.triton.launcher import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def launch(tmp_path, name: str, start_s: float) -> tuple[subprocess.Popen, str]:
    """`python -m serve.launch` of the tiny app ``who``, as `make run` starts the stack."""
    port = free_port()
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "who",
                "route_prefix": "/",
                "import_path": "tests.integration.apps.who:build",
                "args": {"name": name, "start_s": start_s},
            }
        ],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [sys.executable, "-m", "serve.launch", str(path)],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        stdout=(tmp_path / f"{name}.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return process, f"http://127.0.0.1:{port}/who"


def who(url: str) -> str | None:
    try:
        response = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return response.json()["name"] if response.status_code == 200 else None


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def answers_until(url: str, expected: str, process, timeout_s: float) -> list[str]:
    """Every name that answered ``url`` until ``expected`` did."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "serve.launch ended"
        name = who(url)
        if name is not None:
            seen.append(name)
        if name == expected:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"{expected} never answered; seen {sorted(set(seen))}")


def test_a_starting_stack_never_answers_with_another_stacks_app(tmp_path):
    first, first_url = launch(tmp_path, "first", start_s=0)
    second = None
    try:
        answers_until(first_url, "first", first, 180)
        # The second one's ingress takes 40 s to start. Meanwhile its HAProxy sends
        # requests to Serve's fallback proxy: with Ray's default ports that port is
        # shared, and the first stack answered some of them (every ~10 s here).
        second, second_url = launch(tmp_path, "second", start_s=40)
        seen = answers_until(second_url, "second", second, 180)
        assert set(seen) == {"second"}, f"the first stack answered the second's port: {seen}"
        assert who(first_url) == "first"
    finally:
        for process in (first, second):
            if process is not None:
                stop(process)
