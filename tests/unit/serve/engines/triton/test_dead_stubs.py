"""How the replica learns that an engine's Python-backend stub died: Triton 2.51 neither
restarts nor reaps a decoupled model's stub, so its zombie, a child of Triton, says it
(serve.engines.triton.launcher.dead_stubs; the sidecar host's health check reads it)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from serve.engines.triton.launcher import dead_stubs


def _child(tmp_path, name: str, script: str) -> subprocess.Popen:
    """A child of this process whose name (its comm) is ``name``, running ``script`` (a
    shell's builtins only: no grandchild outlives it)."""
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return subprocess.Popen([str(path)], stdin=subprocess.PIPE)


def _dead(child: subprocess.Popen) -> None:
    """Wait until ``child`` is a zombie, unreaped (as Triton leaves a stub)."""
    for _ in range(200):
        with open(f"/proc/{child.pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    pytest.fail("the child did not die")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")
def test_a_stub_killed_by_a_signal_is_found_with_the_signal(tmp_path):
    stub = _child(tmp_path, "triton_python_backend_stub", "kill -KILL $$")
    other = _child(tmp_path, "not_a_stub", "exit 3")  # a dead child of another kind
    try:
        _dead(stub)
        _dead(other)
        assert dead_stubs(os.getpid()) == [f"stub {stub.pid} killed by SIGKILL"]
    finally:
        stub.wait()
        other.wait()
    assert dead_stubs(os.getpid()) == []  # reaped: nothing to report


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux /proc only")
def test_a_live_stub_is_not_dead(tmp_path):
    stub = _child(tmp_path, "triton_python_backend_stub", "read line")  # until stdin ends
    try:
        assert dead_stubs(os.getpid()) == []
    finally:
        stub.communicate()
