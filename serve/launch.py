"""``python -m serve.launch CONFIG``: ``serve run`` in the Serve mode this project ships.

Ray Serve's high-throughput mode (Ray >= 2.55) is the default: HAProxy in front of the
ingress replicas, which serve HTTP themselves, gRPC between replicas, and user code on
each replica's main loop. On ``make bench-capacity`` it halves the serving path's CPU
per streamed token against Serve's defaults (README "Performance"). It is set through
environment variables that every Ray process of the instance must see, so they go
into the environment of ``serve run`` (locally) or of ``ray start`` (a cluster: the
images, compose and the RayService set the same ones).

``--mode default`` runs Ray Serve as it comes (its Python HTTP proxy, Ray's object
streaming between replicas).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SERVE_MODES = ("throughput", "default")

# The variables of the high-throughput mode, as Ray documents them.
THROUGHPUT_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # That mode buffers request-path log lines 1,000 at a time, so a request's id
    # reached the replica logs minutes late (or never, at exit); one line each is
    # cheap at one access line per request.
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}


def serve_env(mode: str, haproxy_dir: Path | None = None, base: dict | None = None) -> dict:
    """The environment for Ray's processes in ``mode``.

    ``haproxy_dir`` gives HAProxy its own files and free stats/metrics ports, so that
    several Serve instances on one machine (tests, benchmarks) do not share
    /tmp/haproxy-serve; its path must be short (the admin socket's path must fit in
    97 bytes).
    """
    if mode not in SERVE_MODES:
        raise ValueError(f"unknown Serve mode {mode!r}; choose one of {', '.join(SERVE_MODES)}")
    env = dict(os.environ if base is None else base)
    if mode == "default":
        return env
    env |= THROUGHPUT_ENV
    if haproxy_dir is not None:
        from serve.triton.launcher import free_port

        env |= {
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(haproxy_dir / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(haproxy_dir / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(haproxy_dir),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(haproxy_dir / "server-state"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        }
    return env


def private_haproxy_dir() -> Path:
    """A short private directory for one instance's HAProxy files (remove it after)."""
    return Path(tempfile.mkdtemp(prefix="hp", dir="/tmp"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve.launch", description=__doc__)
    p.add_argument("config", type=Path, help="a Serve config file (serve/config.yaml)")
    p.add_argument("--mode", choices=SERVE_MODES, default="throughput")
    args = p.parse_args(argv)
    haproxy = private_haproxy_dir() if args.mode == "throughput" else None
    serve = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    process = subprocess.Popen([serve, "run", str(args.config)], env=serve_env(args.mode, haproxy))
    # A SIGTERM for this process stops serve run as a Ctrl-C would.
    signal.signal(signal.SIGTERM, lambda *_: process.send_signal(signal.SIGINT))
    try:
        # Ctrl-C reaches serve run too (one terminal process group): it stops Serve,
        # Ray, HAProxy and the Triton children; this process only waits for that.
        while True:
            try:
                return process.wait()
            except KeyboardInterrupt:
                continue
    finally:
        if haproxy is not None:
            shutil.rmtree(haproxy, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
