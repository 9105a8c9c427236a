"""Find, start, supervise and stop a Triton server as a child process.

Triton comes from the NGC image (``/opt/tritonserver``) or, everywhere else, from
the ``nvidia-pytriton`` wheel, which ships a real Triton 2.51 binary. The wheel's
binary needs three things (checked on these machines): its bundled libraries on
``LD_LIBRARY_PATH``, the Python-backend stub for the running Python inside the
backend folder, and this virtualenv's ``bin/`` first on ``PATH`` so the stub's
interpreter imports this project's packages.

``python -m serve.engines.triton.launcher --model-repository model_repository`` runs it in
the foreground (``make triton``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

NGC_ROOT = Path("/opt/tritonserver")
# Where a Triton's log goes unless the caller names a file: a temp file ``triton-*.log``
# in this directory (set for a test cluster, whose failures print the logs' tails), or in
# the system's temp dir.
LOG_DIR_ENV = "TRITONLLM_TRITON_LOG_DIR"
# The Python-backend stub's process name (its comm, the binary's first 15 bytes).
_STUB_COMM = "triton_python_backend_stub"[:15]

# Triton's Python backend (``--backend-config=python,...``): each stub's shared-memory
# pool, where the server and the stub pass requests' and responses' tensors, starts at
# 1 MiB and grows 1 MiB at a time. A growth makes each side remap the pool on its next
# use, and python_backend swaps its mapping without a lock against the stub's other
# threads (our engine's response thread sends while the main thread takes requests);
# bursts of 256 requests grew the engine stub's pool to 2 MiB here. A pool sized for a
# burst never grows, and tmpfs gives it memory only as its pages are used. (The engine
# stub's SIGSEGVs under load had another cause: tritonllm/decoupled.py:TritonSink.)
PYTHON_BACKEND_CONFIG = {
    "shm-default-byte-size": str(64 * 2**20),
    "shm-growth-byte-size": str(64 * 2**20),
}

# Each stub's pool is a file in /dev/shm (tmpfs: memory) that Triton removes when it
# unloads the model. A Triton that is killed (SIGKILL, the OOM killer, a stop that ran
# out of time) leaves them: 64 MiB a stub, three or four stubs a Triton, held until the
# node restarts (a test run here left 19 GiB). So each Triton's pools are named after
# its launcher's pid (python_backend's shm-region-prefix-name): the launcher removes
# them once its Triton has exited, and each launch removes those of dead launchers
# (which assumes that the processes sharing a /dev/shm share a pid namespace, as in the
# shipped images: one container per pod or service launches Tritons).
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "tritonllm-triton"
_SHM_NAME = re.compile(rf"^{SHM_PREFIX}-(\d+)-")

# glog lines: E1203 07:39:18.761456 7711 model_lifecycle.cc:642] "failed to load ..."
_ERROR_LINE = re.compile(r'^E\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] "?(.*?)"?$')
_HARMLESS = re.compile(r"CudaDriverHelper|NVML|DCGM|cuda", re.IGNORECASE)


class TritonLaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    env: dict[str, str] = field(default_factory=dict)


def _pytriton_install() -> TritonInstall | None:
    try:
        import pytriton
    except ImportError:
        return None
    root = Path(pytriton.__file__).parent / "tritonserver"
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.exists():
        raise TritonLaunchError(f"nvidia-pytriton has no Python-backend stub for Python {py}")
    backend_dir = _backend_dir_with_stub(root / "backends", stub)
    # The stub must load the libpython of *this* interpreter: a system libpython of
    # another patch release (Debian's 3.11.2 beside pyenv's 3.11.7) fails on the
    # stdlib's extension modules (undefined symbol _PyModule_Add).
    libdir = sysconfig.get_config_var("LIBDIR")
    ld_path = os.pathsep.join(filter(None, [libdir, str(libs), os.environ.get("LD_LIBRARY_PATH")]))
    return TritonInstall(root / "bin" / "tritonserver", backend_dir, {"LD_LIBRARY_PATH": ld_path})


def _backend_dir_with_stub(backends: Path, stub: Path) -> Path:
    """A copy of the wheel's backends with the stub for this Python placed in it."""
    target = Path(sys.prefix) / "share" / "tritonllm" / "backends"
    stub_copy = target / "python" / "triton_python_backend_stub"
    if not stub_copy.exists() or stub_copy.stat().st_size != stub.stat().st_size:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(backends, target)
        shutil.copy2(stub, stub_copy)
    return target


def find_triton() -> TritonInstall:
    """The server to run: $TRITONSERVER_BIN, the NGC image's, or the pytriton wheel's."""
    if os.environ.get("TRITONSERVER_BIN"):
        binary = Path(os.environ["TRITONSERVER_BIN"])
        backends = Path(os.environ.get("TRITON_BACKEND_DIR", binary.parent.parent / "backends"))
        return TritonInstall(binary, backends)
    if (NGC_ROOT / "bin" / "tritonserver").exists():
        return TritonInstall(NGC_ROOT / "bin" / "tritonserver", NGC_ROOT / "backends")
    install = _pytriton_install()
    if install is None:
        raise TritonLaunchError(
            "no Triton server found: install the CPU server with "
            "`pip install nvidia-pytriton==0.7.0` (make venv does), "
            "run inside the NGC tritonserver image, or set TRITONSERVER_BIN"
        )
    _check_libpython()
    return install


def _check_libpython() -> None:
    """The wheel's stub links the shared libpython of this Python version."""
    py_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    name = f"libpython{py_version}.so.1.0"
    if ctypes.util.find_library(f"python{py_version}"):
        return
    if (Path(sysconfig.get_config_var("LIBDIR") or "") / name).exists():
        return
    raise TritonLaunchError(
        f"{name} not found: the Python backend stub needs a shared libpython "
        f"(Debian/Ubuntu: apt-get install libpython{py_version})"
    )


# Ports chosen here come from a range the kernel never hands out by itself: above Ray's
# worker ports (10002-19999) and below Serve's direct-ingress defaults (30000-31000)
# and Linux's ephemeral range (32768-60999). A port from bind(0) is an ephemeral one,
# which the kernel also gives every outgoing connection as its local port: one chosen
# now and bound a minute later (HAProxy's, once a cluster is up) can meanwhile be a
# connection's, and the bind fails.
RESERVABLE_PORTS = range(20000, 30000)
# Ports this process handed out, so that two calls before either port is bound differ.
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now, on every interface, that no other call here has returned."""
    return free_port_range(1)


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive ports that are free now (see ``free_port``)."""
    for _ in range(10_000):
        first = random.randrange(RESERVABLE_PORTS.start, RESERVABLE_PORTS.stop - count + 1)
        ports = range(first, first + count)
        if _handed_out.isdisjoint(ports) and all(map(_bindable, ports)):
            _handed_out.update(ports)
            return first
    raise RuntimeError(f"no {count} consecutive free ports in {RESERVABLE_PORTS}")


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:
    """Child-side: get SIGTERM when the parent dies, so no Triton is orphaned (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class TritonProcess:
    """A Triton server child process on 127.0.0.1."""

    def __init__(
        self,
        model_repository: Path | str,
        http_port: int = 0,
        grpc_port: int = 0,
        metrics_port: int = 0,
        extra_args: tuple[str, ...] = (),
        log_path: Path | None = None,
    ):
        self.model_repository = Path(model_repository).resolve()
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.extra_args = extra_args
        if log_path is None:
            log_dir = os.environ.get(LOG_DIR_ENV) or None
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
            log_path = Path(tempfile.mkstemp(prefix="triton-", suffix=".log", dir=log_dir)[1])
        self.log_path = log_path
        # Unique per Triton of this process: <prefix>-<launcher pid>-<random>-<stub's id>.
        self.shm_prefix = f"{SHM_PREFIX}-{os.getpid()}-{random.getrandbits(48):012x}-"
        self._proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def command(self, install: TritonInstall) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={install.backend_dir}",
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--disable-auto-complete-config",
            *(
                f"--backend-config=python,{key}={value}"
                for key, value in PYTHON_BACKEND_CONFIG.items()
            ),
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 120.0, stdout=None) -> TritonProcess:
        if not self.model_repository.is_dir():
            raise TritonLaunchError(f"model repository {self.model_repository} does not exist")
        install = find_triton()
        remove_orphaned_pools()
        env = {**os.environ, **install.env}
        # The stub's embedded interpreter finds this venv's packages through PATH.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        out = stdout or open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        where = "" if stdout else f" (log: {self.log_path})"
        log.info("starting %s%s", " ".join(self.command(install)), where)
        self._proc = subprocess.Popen(
            self.command(install),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        self.wait_ready(timeout_s)
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise TritonLaunchError(
                    f"Triton exited with code {self._proc.returncode} before it was ready: "
                    + "\n".join(self.error_lines() or ["(no error line)"])
                    + "\n--- log tail ---\n"
                    + self.log_tail(20)
                )
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise TritonLaunchError(
            f"Triton was not ready after {timeout_s:.0f} s:\n" + self.log_tail()
        )

    def error_lines(self) -> list[str]:
        """Triton's own error lines (``E<date> ...``), the harmless CPU-only ones left
        out: why a model failed to load, first."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        found = []
        for line in text.splitlines():
            match = _ERROR_LINE.match(line)
            if match and not _HARMLESS.search(line):
                message = match.group(1).encode().decode("unicode_escape", errors="replace")
                found.append(message.split("\n\nAt:")[0].strip())
        return found

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def poll(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def dead_stubs(self) -> list[str]:
        """How this Triton's Python-backend stubs that died on their own died (see
        :func:`dead_stubs`); empty while they all live."""
        return [] if self._proc is None or self.poll() is not None else dead_stubs(self.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop Triton (SIGTERM, then SIGKILL after ``timeout_s``), or find it exited;
        then remove the shared-memory pools it left."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for pool in self.shared_memory_pools():
            pool.unlink(missing_ok=True)

    def shared_memory_pools(self) -> list[Path]:
        """Its stubs' shared-memory pools (files in /dev/shm)."""
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    def __enter__(self):
        return self.start() if self._proc is None else self

    def __exit__(self, *exc):
        self.stop()


def remove_orphaned_pools(directory: Path = SHM_DIR) -> list[str]:
    """Remove the shared-memory pools of Tritons whose launcher is gone (they were
    killed with it, or it was killed before it could remove them); their names."""
    removed = []
    for path in directory.glob(f"{SHM_PREFIX}-*"):
        match = _SHM_NAME.match(path.name)
        if match and not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        log.info("removed %d shared-memory pools of dead Tritons", len(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return True


def dead_stubs(triton_pid: int) -> list[str]:
    """The Python-backend stubs of Triton ``triton_pid`` that died on their own, with how
    (``"stub 4242 killed by SIGKILL"``): their zombies, unreaped.

    Triton 2.51's Python backend neither restarts a decoupled model's dead stub nor
    reaps it (the backend waits for a stub only when it stops it), and the model stays
    "ready": every later request to it fails with "Stub process '<model>_0_0' is not
    healthy", while those it was running never end. A SIGKILL is the kernel's OOM
    killer's mark (or a person's); SIGSEGV, SIGBUS or SIGABRT a crash (after XGrammar's
    import, a SIGSEGV's native stack is in Triton's log: tvm-ffi's handler prints it).
    """
    found = []
    for pid, fields in python_stubs(triton_pid).items():
        if fields[0] == "Z":
            status = int(fields[49]) if len(fields) > 49 else -1  # exit_code (Linux >= 3.5)
            found.append(f"stub {pid} {_exit_status(status)}")
    return found


def python_stubs(triton_pid: int) -> dict[int, list[str]]:
    """Triton ``triton_pid``'s Python-backend stub children, live or zombie: each one's
    ``/proc/<pid>/stat`` fields after its name (the state first)."""
    stubs = {}
    for task in Path(f"/proc/{triton_pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if stat[stat.index("(") + 1 : stat.rindex(")")] == _STUB_COMM:
                stubs[int(pid)] = stat.rsplit(")", 1)[1].split()
    return stubs


def _exit_status(status: int) -> str:
    if status < 0:
        return "exited"
    if os.WIFSIGNALED(status):
        try:
            return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        except ValueError:
            return f"killed by signal {os.WTERMSIG(status)}"
    return f"exited with code {os.WEXITSTATUS(status)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m serve.engines.triton.launcher",
        description="Run Triton in the foreground on a model repository.",
    )
    p.add_argument("--model-repository", default="model_repository")
    p.add_argument("--http-port", type=int, default=8010)
    p.add_argument("--grpc-port", type=int, default=8011)
    p.add_argument("--metrics-port", type=int, default=8012)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    server = TritonProcess(args.model_repository, args.http_port, args.grpc_port, args.metrics_port)
    if not any(server.model_repository.glob("*/config.pbtxt")):
        print(f"{server.model_repository} is not built: run `make engines` first", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.start(args.timeout, stdout=sys.stdout)
        log.info(
            "Triton ready: HTTP %s, gRPC %s, metrics 127.0.0.1:%d (Ctrl-C stops)",
            server.http_url,
            server.grpc_url,
            server.metrics_port,
        )
        while server.poll() is None:
            time.sleep(0.5)
    except TritonLaunchError as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
