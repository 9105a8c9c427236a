"""``make run`` in a terminal: it answers, and Ctrl-C stops every process it started.

The test is the user: ``make run`` in a pseudo-terminal of its own, the interrupt
character typed once the app answers. Ray's processes, HAProxy and the Tritons do not
all stay in the terminal's process group, so the processes are found by the
environment they inherit: a Ray temp dir (``RAY_TMPDIR``) private to this run.
"""

from __future__ import annotations

import os
import pty
import shutil
import signal
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import pytest

from serve.triton.launcher import free_port
from tests.conftest import ROOT
from tests.integration.test_serve_app import wait_ready

pytestmark = pytest.mark.integration
STOP_WITHIN_S = 15


def wait_for_tritons(marker: bytes, count: int, timeout_s: float) -> dict[int, str]:
    """The marked processes once ``count`` of them are Triton servers."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = processes_with(marker)
        tritons = sum("tritonserver" in cmd for cmd in running.values())
        if tritons >= count:
            return running
        assert time.monotonic() < deadline, f"{tritons} of {count} Tritons: {running}"
        time.sleep(1)


def processes_with(marker: bytes) -> dict[int, str]:
    """Live processes whose environment holds ``marker``: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited, waiting for its parent to reap it
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


class Terminal:
    """A command in a pseudo-terminal, its output copied to ``log`` as it comes."""

    def __init__(self, argv: list[str], env: dict, cwd: Path, log: Path):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a session of its own, the pty its terminal
            os.chdir(cwd)
            # As a login shell starts it: a runner that started these tests in the
            # background (bash's `&`) left SIGINT ignored, which exec would pass on.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        self.log = log
        self.status: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self.log.open("wb", buffering=0) as out:
            while True:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the terminal closed
                    return
                if not chunk:
                    return
                out.write(chunk)

    def interrupt(self) -> None:
        """Type the terminal's interrupt character (Ctrl-C)."""
        os.write(self.fd, termios.tcgetattr(self.fd)[6][termios.VINTR])

    def exited(self) -> bool:
        if self.status is None and os.waitpid(self.pid, os.WNOHANG)[0] == self.pid:
            self.status = "exited"
        return self.status is not None

    def poll(self) -> str | None:
        """None while the command runs (as ``Popen.poll``)."""
        return None if not self.exited() else self.status

    def tail(self) -> str:
        return self.log.read_bytes()[-4000:].decode(errors="replace")


def wait_for_exit(marker: bytes, limit_s: float, poll_s: float = 0.2) -> tuple[float, dict]:
    """Seconds until no process holds ``marker`` (at most ``limit_s``), and what is left."""
    started = time.monotonic()
    while (left := processes_with(marker)) and time.monotonic() - started < limit_s:
        time.sleep(poll_s)
    return time.monotonic() - started, left


def kinds(processes: dict[int, str]) -> set[str]:
    """Which parts of the stack are among ``processes``."""
    parts = {"raylet": "raylet", "gcs_server": "gcs_server", "haproxy": "haproxy"}
    parts |= {"tritonserver": "tritonserver", "serve run": "serve run"}
    return {kind for cmd in processes.values() for key, kind in parts.items() if key in cmd}


def test_ctrl_c_on_make_run_stops_serve_ray_haproxy_and_every_triton(
    built_repository, built_embedding_repository, tmp_path
):
    ray_tmp = tempfile.mkdtemp(prefix="mkrun", dir="/tmp")  # short: Ray's socket paths
    marker = f"RAY_TMPDIR={ray_tmp}".encode()
    port = free_port()
    env = os.environ | {"RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    argv = ["make", "run", "NO_VENV=1", f"PYTHON={sys.executable}", f"PORT={port}"]
    terminal = Terminal(argv, env, ROOT, tmp_path / "make-run.log")
    try:
        wait_ready(f"http://127.0.0.1:{port}", terminal, terminal.log, timeout_s=240)
        # One Triton per replica, the LLM's and the embeddings model's. Waited for as
        # well: another Ray instance on the machine (a previous test's, shutting down)
        # can hold the ingress replicas' default port and answer /health first.
        running = wait_for_tritons(marker, count=2, timeout_s=240)
        assert {"serve run", "raylet", "gcs_server", "haproxy"} <= kinds(running), running

        terminal.interrupt()
        took, left = wait_for_exit(marker, STOP_WITHIN_S)
        assert not left, f"still running {STOP_WITHIN_S} s after Ctrl-C: {kinds(left)} {left}"
        assert terminal.exited(), terminal.tail()
        print(f"everything stopped {took:.1f} s after Ctrl-C")
    finally:
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)
        if not terminal.exited():
            os.kill(terminal.pid, signal.SIGKILL)
            os.waitpid(terminal.pid, 0)
        os.close(terminal.fd)
        shutil.rmtree(ray_tmp, ignore_errors=True)
