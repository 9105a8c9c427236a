"""A client that gives up on a non-streamed answer cancels its generation, in both HTTP
front modes (the shipped one, HAProxy in front, is tested on test_serve_app.py's stack).

Serve itself cancels an HTTP request whose client left, once the disconnect reaches
it: the ingress replica's own server (high-throughput mode) or Serve's proxy (default
mode) races the ASGI call against ``http.disconnect`` and cancels the call, whose
handle calls the ingress then cancels. The mode's weak link was HAProxy, which must
pass each client's close on to the replica.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
import yaml

from serve.engines.triton.launcher import free_port
from serve.launch import serve_env
from tests.conftest import ROOT
from tests.integration.abandon import IDLE_WITHIN_S, SHORT_WITHIN_S, abandon_then_serve
from tests.integration.repositories import repository_with_limits
from tests.integration.test_serve_app import launched

# quiet: the engine freed within seconds of a client leaving is a time bound.
pytestmark = [pytest.mark.integration, pytest.mark.quiet]


def rays_haproxy_settings(folder) -> str:
    """The ``global`` and ``defaults`` sections of the HAProxy config Ray Serve writes
    (``option abortonclose``, ``option splice-request``, ...), from Ray's template."""
    from jinja2 import Environment
    from ray.serve._private.haproxy import HAProxyConfig
    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE

    config = HAProxyConfig(
        socket_path=str(folder / "admin.sock"),
        server_state_base=str(folder),
        server_state_file=str(folder / "server-state"),
    )
    head = HAPROXY_CONFIG_TEMPLATE[: HAPROXY_CONFIG_TEMPLATE.index("frontend prometheus")]
    return Environment(keep_trailing_newline=True).from_string(head).render(config=config)


class DisconnectRecorder:
    """An ASGI app that reads a request, then waits up to 5 s for the client to leave
    and records what its ``receive`` said, by path."""

    def __init__(self):
        self.seen: dict[str, str] = {}

    async def __call__(self, scope, receive, send):
        await receive()  # the (one-message) body
        try:
            message = await asyncio.wait_for(receive(), 5)
            self.seen[scope["path"]] = message["type"]
        except asyncio.TimeoutError:  # TimeoutError itself on 3.11+
            self.seen[scope["path"]] = "no disconnect within 5 s"
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})


def wait_listening(port: int, process=None, log=None, timeout_s: float = 10) -> None:
    """Until ``port`` accepts connections (``process``, which should listen there, must
    not exit meanwhile: its ``log`` says why)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(log.read_text() if log else "it exited")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def test_haproxy_as_serve_runs_it_passes_every_client_close_on(tmp_path):
    """Ray's HAProxy settings and the binary ``serve.launch`` gives Ray: 20 clients that
    give up on their request are 20 disconnects at the server behind it. (With Ray's
    own binary, kernel splicing on, about half of them were never seen.)"""
    recorder = DisconnectRecorder()
    server_port, proxy_port = free_port(), free_port()
    server = uvicorn.Server(
        uvicorn.Config(recorder, port=server_port, lifespan="off", log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        rays_haproxy_settings(tmp_path)
        + f"frontend http\n    bind 127.0.0.1:{proxy_port}\n    default_backend replica\n"
        + f"backend replica\n    http-reuse always\n    server s 127.0.0.1:{server_port}\n"
    )
    env = serve_env("throughput")
    command = [env["RAY_SERVE_HAPROXY_BINARY_PATH"], "-db", "-f", str(config)]
    log = tmp_path / "haproxy.log"
    haproxy = subprocess.Popen(command, env=env, stderr=log.open("w"))
    try:
        wait_listening(server_port)
        wait_listening(proxy_port, haproxy, log)

        context = ssl.create_default_context()  # one for all: each costs ~20 ms of CPU

        def give_up(i: int) -> None:
            with httpx.Client(timeout=0.3, verify=context) as client:
                with pytest.raises(httpx.TimeoutException):
                    client.post(f"http://127.0.0.1:{proxy_port}/{i}", json={})

        with ThreadPoolExecutor(20) as pool:
            list(pool.map(give_up, range(20)))
        deadline = time.monotonic() + 2
        while len(recorder.seen) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert recorder.seen == {f"/{i}": "http.disconnect" for i in range(20)}
    finally:
        haproxy.terminate()
        haproxy.wait(10)
        server.should_exit = True


@pytest.fixture(scope="module")
def default_mode_stack(checkpoint_dir, tmp_path_factory):
    """`serve.launch --mode default` (Serve's own proxy) of the shipped config's LLM over
    a one-slot repository, its replicas taking 4 requests at a time: the rest of a
    burst waits in the ingress's handle queue. Yields (url, repository)."""
    scratch = tmp_path_factory.mktemp("default_mode")
    repository = repository_with_limits(
        checkpoint_dir, scratch / "model_repository", "--max-batch-size", "1"
    )
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    model = args["models"][0]
    args["models"] = [model]  # the LLM alone: one Triton to start
    model["triton"]["model_repository"] = str(repository)
    model["deployment"].pop("autoscaling_config")
    model["deployment"] |= {"num_replicas": 1, "max_ongoing_requests": 4}
    (scratch / "config.yaml").write_text(yaml.safe_dump(config))
    config_path = scratch / "config.yaml"
    with launched(config_path, port, scratch / "serve.log", "--mode", "default") as url:
        yield url, repository


def test_in_the_default_mode_clients_that_give_up_free_the_engine_at_once(default_mode_stack):
    """Serve's proxy sees each client leave and cancels its call to the ingress; the
    ingress cancels its handle calls, running or still queued in Serve."""
    url, repository = default_mode_stack
    idle_s, short_s = abandon_then_serve(url, repository)
    assert idle_s < IDLE_WITHIN_S and short_s < SHORT_WITHIN_S, (idle_s, short_s)
