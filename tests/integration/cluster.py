"""A real Ray cluster for the tests: ``ray start --head`` and ``serve deploy``, as a user runs it.

Token authentication is on, as docker/compose.yaml runs it: every ``ray`` and
``serve`` command gets ``RAY_AUTH_MODE=token`` and a token of this cluster's own in
``RAY_AUTH_TOKEN`` (the ``serve`` CLI sends it only in that mode; with the mode set and
no token, ``ray start`` refuses, which a fresh machine has unless it was given one).

The cluster runs in the Serve mode ``make run`` and the images ship
(:mod:`serve.launch`: Ray's high-throughput mode, HAProxy in front), HAProxy with
files of its own. Everything the cluster starts carries its own temp dir (HAProxy:
its own dir) in its command line, so ``stop`` ends exactly this cluster's processes
(``ray stop`` would end every Ray on the machine) and the Triton children follow
their replicas (PDEATHSIG).
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from serve.engines.triton.launcher import LOG_DIR_ENV, dead_stubs, free_port
from serve.launch import private_haproxy_dir, serve_env
from tests.conftest import ROOT

BIN = Path(sys.executable).parent


class RayNode:
    """A worker node: its own ``ray start`` (raylet, agents, workers) with its own temp
    dir, which names it in the command line of each of its processes."""

    def __init__(self, name: str, temp_dir: Path, host: str = "127.0.0.1"):
        self.name, self.temp_dir, self.host = name, temp_dir, host
        self.proxy_port: int | None = None

    @property
    def url(self) -> str:
        """Where the node's own Serve proxy listens (``add_node``'s ``own_proxy``)."""
        assert self.proxy_port is not None, f"{self.name} has no proxy port of its own"
        return f"http://{self.host}:{self.proxy_port}"

    def pids(self) -> list[int]:
        """Every process of the node: those naming its temp dir (raylet, agents, Ray
        workers) and their descendants (a replica's Triton)."""
        return descendants(processes_naming(str(self.temp_dir).encode()))

    def kill(self) -> None:
        """The node fails as a machine does: every process of it at once (SIGKILL)."""
        for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped first: nothing respawns
            for pid in self.pids():
                signal_pid(pid, sig)


class RayCluster:
    """``node_ip``: the address every node registers with (``--node-ip-address``), and
    Serve's ``http_options.host`` in :meth:`deploy`. Ray's default is the machine's
    own address, where Serve's HAProxy reaches the ingress replicas (its targets: their
    node's address) only if they listen beyond loopback; "127.0.0.2" keeps it all on
    loopback (Ray replaces 127.0.0.1 with the machine's address)."""

    def __init__(
        self,
        num_cpus: int = 4,
        env: dict | None = None,
        node_ip: str | None = None,
        mode: str = "throughput",
    ):
        # Short: Ray's socket paths live under it and must fit in 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.metrics_port = free_port()
        self.http_port = free_port()
        self.num_cpus = num_cpus
        self.haproxy_dir = private_haproxy_dir()
        self.mode = mode  # serve.launch's Serve mode
        self.env = serve_env(mode, self.haproxy_dir)
        self.env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        # Every replica's Triton logs into a file here (serve.engines.triton.launcher), which
        # outlives the replica: a failed test shows their tails (triton_report).
        self.triton_log_dir = self.temp_dir / "triton"
        self.env[LOG_DIR_ENV] = str(self.triton_log_dir)
        self.env |= env or {}
        self.nodes: list[RayNode] = []
        self._deployed_at = 0.0
        self.node_ip = node_ip
        self._node_ip = [f"--node-ip-address={node_ip}"] if node_ip else []

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def url(self) -> str:
        return f"http://{self.node_ip or '127.0.0.1'}:{self.http_port}"

    def start(self, num_gpus: int = 0) -> RayCluster:
        self._ray(
            "start",
            "--head",
            f"--port={self.gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--metrics-export-port={self.metrics_port}",
            f"--num-cpus={self.num_cpus}",
            f"--num-gpus={num_gpus}",
            f"--temp-dir={self.temp_dir}",
            f"--ray-client-server-port={free_port()}",
            "--disable-usage-stats",
            *self._node_ip,
        )
        return self

    def add_node(
        self,
        name: str,
        num_cpus: float,
        num_gpus: int = 0,
        resources: dict | None = None,
        own_proxy: bool = False,
        env: dict | None = None,
    ) -> RayNode:
        """A worker node joining the head: ``--num-gpus`` declares GPUs to Ray alone (a
        replica placed for one runs on CPU here), ``resources`` are custom ones, ``env``
        the node's own environment variables (over the cluster's).

        ``own_proxy``: the node's Serve proxy (``proxy_location: EveryNode``) listens on
        a port of its own, ``node.url`` (Ray's RAY_SERVE_WORKER_PROXY_HTTP_PORT, which
        the head ignores), where a real node listens on the config's port of its own
        address; its HAProxy gets ports of its own for its stats and metrics too, and
        its ingress replicas their own range."""
        temp_dir = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))
        node = RayNode(name, temp_dir, self.node_ip or "127.0.0.1")
        env = dict(env or {})
        if own_proxy:
            node.proxy_port = free_port()
            fresh = serve_env("throughput", self.haproxy_dir, base={})
            env |= {name: value for name, value in fresh.items() if "_PORT" in name}
            env["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] = str(node.proxy_port)
        self.nodes.append(node)
        self._ray(
            "start",
            f"--address=127.0.0.1:{self.gcs_port}",
            f"--node-name={name}",
            f"--num-cpus={num_cpus}",
            f"--num-gpus={num_gpus}",
            f"--resources={json.dumps(resources or {})}",
            f"--temp-dir={node.temp_dir}",
            f"--metrics-export-port={free_port()}",
            "--disable-usage-stats",
            *self._node_ip,
            env=env,
        )
        return node

    def node_names(self) -> dict[str, str]:
        """Node id to node name (``add_node``'s; the head's is its IP) of the live nodes."""
        response = httpx.get(
            f"{self.dashboard}/api/v0/nodes", headers=self._auth(), params={"limit": 100}
        )
        response.raise_for_status()
        nodes = response.json()["data"]["result"]["result"]
        return {n["node_id"]: n["node_name"] for n in nodes if n["state"] == "ALIVE"}

    def _ray(self, *args: str, env: dict | None = None) -> None:
        subprocess.run(
            [str(BIN / "ray"), *args],
            check=True,
            cwd=ROOT,
            env=self.env | (env or {}),
            capture_output=True,
            timeout=180,
        )

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"}

    def deploy(self, config: dict, timeout_s: float = 120) -> None:
        """``serve deploy`` of a Serve config (its HTTP port set to this cluster's)."""
        config = copy.deepcopy(config)
        config.setdefault("http_options", {})["port"] = self.http_port
        if self.node_ip:
            config["http_options"]["host"] = self.node_ip
        path = self.temp_dir / f"serve-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(config))
        self._deployed_at = time.time()  # wall clock, as Serve's replica start times
        result = subprocess.run(
            [str(BIN / "serve"), "deploy", str(path), "--address", self.dashboard],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if result.returncode != 0:
            raise AssertionError(f"serve deploy failed:\n{result.stdout}\n{result.stderr}")

    def applications(self) -> dict:
        """Serve's REST view of the applications (status, message, deployments, replicas)."""
        response = httpx.get(
            f"{self.dashboard}/api/serve/applications/", headers=self._auth(), timeout=10
        )
        response.raise_for_status()
        return response.json().get("applications", {})

    def deployment(self, app: str, name: str) -> dict:
        return self.applications()[app]["deployments"][name]

    def running_replicas(self, app: str, name: str) -> list[dict]:
        replicas = self.deployment(app, name)["replicas"]
        return [r for r in replicas if r["state"] == "RUNNING"]

    def wait_running(self, app: str = "llm", timeout_s: float = 240, settled: bool = False) -> dict:
        """Until the application serves its latest config; raises with Serve's message
        on failure. A replaced ingress replica stays reachable 30 s after its successor
        runs (Ray's RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, for load balancers
        outside Serve), and Serve reads the app RUNNING only once it has stopped: the
        tests go on meanwhile (Serve's own HAProxy no longer sends it requests) unless
        ``settled`` asks for the app RUNNING."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            details = self.applications().get(app)
            if details and details["status"] == "RUNNING":
                return details
            if details and details["status"] == "DEPLOY_FAILED":
                raise AssertionError(f"{app} failed to deploy: {details['message']}")
            if details and not settled and self._only_draining(details):
                return details
            time.sleep(1)
        raise AssertionError(f"{app} not running after {timeout_s} s: {self.applications()}")

    def _only_draining(self, details: dict) -> bool:
        """Whether what keeps a deploying app from RUNNING is only replicas of the
        config before that are stopping: every deployment has its target of replicas
        running, all started since the last deploy where it has any stopping."""
        deployments = details["deployments"].values()
        if details["status"] != "DEPLOYING" or not deployments:
            return False  # {} while the app's new config is built
        replaced = False
        for deployment in deployments:
            replicas = deployment["replicas"]
            if deployment["status"] == "HEALTHY" and all(r["state"] == "RUNNING" for r in replicas):
                continue
            running = [
                r
                for r in replicas
                if r["state"] == "RUNNING" and r["start_time_s"] >= self._deployed_at
            ]
            others = [r for r in replicas if r["state"] not in ("RUNNING", "STOPPING")]
            if others or len(running) != deployment["target_num_replicas"]:
                return False
            replaced = True
        return replaced

    def kill_gcs(self) -> None:
        """The head's GCS fails (SIGKILL); :meth:`restart_gcs` starts it again as Ray
        started it (same command line and environment), as a restarted head would."""
        head = processes_naming(str(self.temp_dir).encode())
        (pid,) = [p for p in head if process_name(p) == "gcs_server"]
        proc = Path(f"/proc/{pid}")
        self._gcs_command = proc.joinpath("cmdline").read_bytes().split(b"\0")[:-1]
        environ = proc.joinpath("environ").read_bytes().split(b"\0")
        self._gcs_env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        os.kill(pid, signal.SIGKILL)

    def kill_serve_controller(self) -> None:
        """Serve's controller (a Ray worker process of the head: ``ray::ServeController``)
        fails (SIGKILL). With the GCS down, nothing restarts it until the GCS is back."""
        head = descendants(processes_naming(str(self.temp_dir).encode()))
        (pid,) = [p for p in head if b"ray::ServeController" in cmdline(p)]
        os.kill(pid, signal.SIGKILL)

    def restart_gcs(self) -> None:
        log = (self.temp_dir / "gcs-restarted.out").open("ab")
        subprocess.Popen(
            self._gcs_command, env=self._gcs_env, stdout=log, stderr=log, start_new_session=True
        )

    def logs_dir(self) -> Path:
        return self.temp_dir / "session_latest" / "logs"

    def triton_report(self, since: float, lines: int = 60) -> str:
        """What a failed test prints of the cluster's Tritons: their Python-backend
        stubs that died and how, /dev/shm's use (the stubs' shared memory), and the
        tail of each Triton log written since ``since`` (a ``time.time()``) or whose
        Triton lost a stub."""
        report, logs = [], set()
        for path in self.triton_log_dir.glob("*.log"):
            try:
                if path.stat().st_mtime >= since:
                    logs.add(path)
            except OSError:
                pass
        for pid in self.pids():
            if process_name(pid) != "tritonserver" or not (dead := dead_stubs(pid)):
                continue
            try:
                logs.add(Path(os.readlink(f"/proc/{pid}/fd/1")))
            except OSError:
                pass
            report.append(f"tritonserver {pid}: Python-backend {', '.join(dead)}")
        shm = shutil.disk_usage("/dev/shm")
        report.append(f"/dev/shm: {shm.used >> 20} MiB used of {shm.total >> 20} MiB")
        for path in sorted(logs):
            try:
                text = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError as error:
                text = [str(error)]
            report += [f"--- {path}, its last {len(text)} lines ---", *text]
        return "\n".join(report)

    def stop(self) -> None:
        # Descendants too, found while their raylet lives: a node's agents (their command
        # lines name nothing of the cluster) outlived a killed raylet, no one's children.
        # SIGTERM first, for a clean stop where it is quick; the raylet and the GCS take
        # more than 15 s over theirs, which a test's cluster has no need of.
        pids = set(self.pids())
        for sig, grace_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 15)):
            pids |= set(self.pids())
            for pid in pids:
                signal_pid(pid, sig)
            deadline = time.monotonic() + grace_s
            while any(map(alive, pids)) and time.monotonic() < deadline:
                time.sleep(0.5)
        shutil.rmtree(self.haproxy_dir, ignore_errors=True)

    def pids(self) -> list[int]:
        """Every process of the cluster, its nodes' included, and their descendants (each
        replica's Triton and the Python backend stubs under it)."""
        return descendants(self._pids())

    def _pids(self) -> list[int]:
        """Processes of this cluster: their command line names its or a node's temp dir,
        its GCS port or its HAProxy dir."""
        marks = [str(self.temp_dir), f":{self.gcs_port} ", str(self.haproxy_dir)]
        marks += [str(node.temp_dir) for node in self.nodes]
        return processes_naming(*(mark.encode() for mark in marks))


def processes_naming(*marks: bytes) -> list[int]:
    """Processes (not this one) whose command line contains any of ``marks``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ") + b" "
        except OSError:
            continue
        if any(mark in cmdline for mark in marks):
            pids.append(int(proc.name))
    return pids


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process under them."""
    found, queue = [], list(pids)
    while queue:
        pid = queue.pop()
        if pid not in found:
            found.append(pid)
            queue += child_pids(pid)
    return found


def alive(pid: int) -> bool:
    """The process runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve_config(repository: Path, **model_overrides) -> dict:
    """The shipped serve/config.yaml's LLM alone over ``repository``, with its fields
    replaced (``deployment`` is merged key by key)."""
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    args = config["applications"][0]["args"]
    args["models"] = args["models"][:1]
    model = args["models"][0]
    model["triton"]["model_repository"] = str(repository)
    deployment = model_overrides.pop("deployment", {})
    model.update(model_overrides)
    model["deployment"].update(deployment)
    return config


def app_config(models: list[dict]) -> dict:
    """The shipped serve/config.yaml serving ``models`` (AppConfig's ``models`` list)."""
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    config["applications"][0]["args"]["models"] = models
    return config


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, started from any of its threads (a replica starts
    its Triton from a worker thread)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return children


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def triton_http_url(replica: dict, port: str = "http") -> str:
    """The loopback HTTP address of a replica's sidecar Triton (from its command line);
    ``port="metrics"``: its metrics endpoint's."""
    flag = f"--{port}-port=".encode()
    for pid in child_pids(replica["pid"]):
        if process_name(pid) == "tritonserver":
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            ports = [a.split(b"=")[1] for a in cmdline if a.startswith(flag)]
            return f"http://127.0.0.1:{ports[0].decode()}"
    raise AssertionError(f"replica {replica['replica_id']} has no Triton child")


def triton_index(replica: dict) -> dict[str, str]:
    """The replica's Triton repository index: model name to state."""
    response = httpx.post(f"{triton_http_url(replica)}/v2/repository/index", json={}, timeout=10)
    return {m["name"]: m.get("state", "") for m in response.json()}


class RedisServer:
    """A private redis-server (Debian's, from ``make redis``) on a free loopback port,
    where Ray's GCS keeps the cluster's state with fault tolerance on."""

    UNPACKED = ROOT / "build" / "redis" / "usr"

    def __init__(self):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="redis", dir="/tmp"))
        self._process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server") or self.UNPACKED / "bin" / "redis-server"
        env = os.environ | {"LD_LIBRARY_PATH": str(self.UNPACKED / "lib" / "x86_64-linux-gnu")}
        self._process = subprocess.Popen(
            [str(binary), "--port", str(self.port), "--bind", "127.0.0.1"]
            + ["--dir", str(self.dir), "--save", "", "--appendonly", "no"],
            env=env,
            stdout=(self.dir / "redis.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not self._pong():
            if self._process.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "redis.log").read_text()
                raise AssertionError(f"redis-server did not start (make redis):\n{log}")
            time.sleep(0.2)
        return self

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)
