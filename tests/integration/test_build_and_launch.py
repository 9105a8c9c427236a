"""`make engines` and the Triton launcher as a user meets them."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from serve.engines.triton.launcher import (
    PYTHON_BACKEND_CONFIG,
    TritonLaunchError,
    TritonProcess,
    python_stubs,
)
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_default_model_is_deterministic(tmp_path, built_repository, checkpoint_dir):
    copy = tmp_path / "model_repository"
    shutil.copytree(built_repository, copy, ignore=shutil.ignore_patterns("hf_model"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build_engines",
            "--only",
            "llm",
            "--repository",
            str(copy),
            "--force",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(copy / "tensorrt_llm/1/hf_model" / name) == digest(checkpoint_dir / name)


def test_a_build_leaves_git_status_clean(built_repository, built_embedding_repository):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", "model_repository", "embedding_repository"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert status == ""


def test_a_second_build_is_skipped(built_repository):
    out = subprocess.run(
        [sys.executable, "-m", "build_engines", "--only", "llm"]
        + ["--repository", str(built_repository)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "up to date" in out.stderr


def test_a_repository_that_fails_to_load_reports_tritons_error(tmp_path, built_repository):
    repo = tmp_path / "model_repository"
    shutil.copytree(built_repository, repo, ignore=shutil.ignore_patterns("hf_model"))
    config = repo / "tensorrt_llm" / "config.pbtxt"
    config.write_text(config.read_text().replace("tensorrt_llm/1/hf_model", "/nonexistent"))
    with pytest.raises(TritonLaunchError, match="no config.json"):
        TritonProcess(repo).start(timeout_s=120)


def test_triton_does_not_outlive_its_parent_and_unloads_its_models_cleanly(built_repository):
    script = textwrap.dedent(f"""
        import sys, time
        from serve.engines.triton.launcher import TritonProcess
        server = TritonProcess({str(built_repository)!r}).start(timeout_s=120)
        print(server._proc.pid, server.log_path, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    pid, log_path = parent.stdout.readline().split()
    triton_pid = int(pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(triton_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(triton_pid, signal.SIGKILL)
        pytest.fail("tritonserver kept running after its parent was killed")
    # Its SIGTERM unloads every model: no stub may crash on the way out (the engine's
    # metrics are released in its finalize, tritonllm/triton_metrics.py).
    log = Path(log_path).read_text(errors="replace")
    assert "Segfault" not in log and "Fatal Python error" not in log, log[-3000:]


def test_each_python_stub_has_a_shared_memory_pool_that_a_burst_does_not_grow(triton):
    """python_backend's pool grows 1 MiB at a time by default, remapped under the stub's
    threads at each growth, and bursts of requests grew it (launcher.PYTHON_BACKEND_CONFIG)."""
    regions = {}  # stub pid -> its pool's name (the stub's second argument)
    for pid in python_stubs(triton.pid):
        regions[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2].decode()
    assert len(regions) >= 3  # preprocessing, tensorrt_llm, postprocessing
    pool_bytes = int(PYTHON_BACKEND_CONFIG["shm-default-byte-size"])
    assert pool_bytes >= 64 * 2**20
    for name in regions.values():
        assert name.startswith(triton.shm_prefix)  # named to be removed (next test)
        assert os.stat(f"/dev/shm/{name}").st_size >= pool_bytes


def test_a_killed_tritons_shared_memory_is_removed_by_its_launcher(built_repository):
    """Triton removes its stubs' pools when it unloads; killed, it leaves them (64 MiB a
    stub in tmpfs, that is memory) until its launcher's stop() finds it exited."""
    server = TritonProcess(built_repository).start(timeout_s=180)
    try:
        pools = server.shared_memory_pools()
        assert len(pools) >= 3, pools  # preprocessing, tensorrt_llm, postprocessing
        os.kill(server.pid, signal.SIGKILL)
        server._proc.wait(30)
        assert all(pool.exists() for pool in pools)  # what a killed Triton leaves
    finally:
        server.stop()
    assert not any(pool.exists() for pool in pools)
