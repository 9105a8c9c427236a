"""``make run`` in a terminal: it answers, listens on loopback only, and Ctrl-C (or a
SIGTERM to its process group, as ``docker stop``, systemd and Kubernetes send) stops
every process it started and frees their ports.

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
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import pytest

from serve.engines.triton.launcher import free_port
from tests.conftest import ROOT
from tests.integration.test_serve_app import wait_ready
from tests.processes import (
    is_loopback_address,
    listener_sockets,
    listening_inodes,
    processes_with_env,
)

pytestmark = pytest.mark.integration
# Serve stops its replicas, their Tritons, then Ray: 12-28 s measured with other stacks
# running (load average up to 13 on 2 cores); well within the drain time a stopping
# replica gets with requests in flight (132 s for serve/config.yaml's LLM).
STOP_WITHIN_S = 60


def wait_for_tritons(marker: bytes, count: int, timeout_s: float) -> dict[int, str]:
    """The marked processes once ``count`` of them are Triton servers."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = processes_with_env(marker)
        tritons = sum("tritonserver" in cmd for cmd in running.values())
        if tritons >= count:
            return running
        assert time.monotonic() < deadline, f"{tritons} of {count} Tritons: {running}"
        time.sleep(1)


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
    while (left := processes_with_env(marker)) and time.monotonic() - started < limit_s:
        time.sleep(poll_s)
    return time.monotonic() - started, left


def kinds(processes: dict[int, str]) -> set[str]:
    """Which parts of the stack are among ``processes``."""
    parts = {"raylet": "raylet", "gcs_server": "gcs_server", "haproxy": "haproxy"}
    parts |= {"tritonserver": "tritonserver", "serve run": "serve run"}
    return {kind for cmd in processes.values() for key, kind in parts.items() if key in cmd}


def sockets_of(processes: dict[int, str]) -> dict[str, tuple[str, int, str]]:
    """Inode -> (address, port, command) of every listening socket of ``processes``."""
    held = {}
    for pid, cmd in processes.items():
        try:
            sockets = listener_sockets(pid)
        except OSError:  # gone meanwhile
            continue
        held |= {inode: (host, port, cmd.split(" ")[0]) for inode, (host, port) in sockets.items()}
    return held


def serve_ports(running: dict[int, str]) -> set[int]:
    """The ports serve/launch.py gave Serve's HTTP parts (in serve run's environment)."""
    pid = next(pid for pid, cmd in running.items() if "serve run" in cmd)
    env = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
        if "=" in item
    )
    ports = {
        int(env[f"RAY_SERVE_{name}_PORT"]) for name in ("FALLBACK_PROXY_HTTP", "HAPROXY_STATS")
    }
    ports.add(int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]))
    low, high = (int(env[f"RAY_SERVE_DIRECT_INGRESS_{e}_HTTP_PORT"]) for e in ("MIN", "MAX"))
    return ports | set(range(low, high + 1))


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_make_run_listens_on_loopback_and_stops_every_process_and_port(
    stop, built_repository, built_embedding_repository, tmp_path
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
        # `ss -ltn` for the stack's processes: with the default host, what serves
        # HTTP listens on loopback only: the API, HAProxy's stats and Prometheus ports,
        # Serve's fallback proxy and the ingress replicas' own ports, every Triton.
        # (Ray's own gRPC servers bind every interface, as Ray 2.60 always does.)
        sockets = sockets_of(running)
        held = set(sockets.values())
        assert port in {p for _, p, _ in held}, held
        served = serve_ports(running) | {port}
        ours = {h for h in held if h[1] in served or "haproxy" in h[2] or "tritonserver" in h[2]}
        assert len(ours) >= 5, held  # the API, 2 of HAProxy's, 2 Tritons' at least
        beyond = {h for h in ours if not is_loopback_address(h[0])}
        assert not beyond, f"listening beyond loopback: {sorted(beyond)}"

        if stop == "ctrl-c":
            terminal.interrupt()
        else:  # the session's one process group: make, and what stayed in it
            os.killpg(terminal.pid, signal.SIGTERM)
        took, left = wait_for_exit(marker, STOP_WITHIN_S)
        assert not left, f"still running {STOP_WITHIN_S} s after {stop}: {kinds(left)} {left}"
        assert terminal.exited(), terminal.tail()
        # Their sockets closed: a port of Ray's fixed defaults (the dashboard agent's
        # 52365) may be another Ray instance's on this machine by then.
        still = sorted(sockets[inode] for inode in set(sockets) & listening_inodes())
        assert not still, f"sockets still listening after {stop}: {still}"
        print(f"everything stopped {took:.1f} s after {stop}, {len(held)} ports free")
    finally:
        for pid in processes_with_env(marker):
            os.kill(pid, signal.SIGKILL)
        if not terminal.exited():
            os.kill(terminal.pid, signal.SIGKILL)
            os.waitpid(terminal.pid, 0)
        os.close(terminal.fd)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_make_run_beyond_loopback_without_keys_exits_saying_how_to_set_them(
    built_repository, built_embedding_repository
):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITONLLM_API_KEYS",)}
    env.pop("TRITONLLM_OPEN_API", None)
    argv = ["make", "run", "NO_VENV=1", f"PYTHON={sys.executable}", "HOST=0.0.0.0"]
    argv.append(f"PORT={free_port()}")
    started = time.monotonic()
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "refusing to serve an API without keys on 0.0.0.0" in done.stderr, done.stderr
    assert "TRITONLLM_API_KEYS" in done.stderr and "OPEN_API=1" in done.stderr
    assert "Serving on" not in done.stdout
    print(f"refused after {time.monotonic() - started:.1f} s")
