"""The end of a test run: a process it started and left running fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, TEST_RUN_ENV

LEAKY = """
import os
import subprocess

def test_leaves_a_process_behind():
    # Its own session, as Ray's and HAProxy's processes are: no process group stops it.
    leaked = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open(os.environ["LEAKED_PID_FILE"], "w") as out:
        out.write(str(leaked.pid))

def test_cleans_up():
    subprocess.run(["true"], check=True)
"""


def run_pytest(test_file: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest on ``test_file`` with this suite's conftest as a plugin (its own run)."""
    env = {k: v for k, v in os.environ.items() if k != TEST_RUN_ENV}
    env["LEAKED_PID_FILE"] = str(test_file.parent / "leaked.pid")
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # seconds of imports the run needs none of
    env["TRITONLLM_LEFTOVER_GRACE_S"] = "1"
    command = [sys.executable, "-m", "pytest", str(test_file), "-p", "tests.conftest"]
    command += ["-p", "no:cacheprovider", "-o", "addopts=", "-o", "timeout=0"]
    command += ["--rootdir", str(test_file.parent), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_process_left_running_fails_the_run_named_and_is_killed(tmp_path):
    test_file = tmp_path / "test_leaky.py"
    test_file.write_text(LEAKY)
    run = run_pytest(test_file)
    pid = int((tmp_path / "leaked.pid").read_text())
    try:
        assert run.returncode == 1, run.stdout[-3000:]
        assert "2 passed" in run.stdout  # the tests passed; the run did not
        assert "processes left behind" in run.stdout
        assert f"{pid}: sleep 300" in run.stdout
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # killed; its new parent (init) reaps it
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, 9)


def test_a_run_that_stops_what_it_starts_passes(tmp_path):
    test_file = tmp_path / "test_clean.py"
    test_file.write_text(LEAKY)
    run = run_pytest(test_file, "-k", "cleans_up")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "processes left behind" not in run.stdout
