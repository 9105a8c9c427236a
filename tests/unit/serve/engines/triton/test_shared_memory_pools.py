"""A killed Triton's shared-memory pools (files in /dev/shm, 64 MiB a stub) are removed:
by its launcher once it has exited, or by the next launch when the launcher is gone too
(serve.engines.triton.launcher.remove_orphaned_pools)."""

from __future__ import annotations

import os
import subprocess

from serve.engines.triton.launcher import SHM_PREFIX, TritonProcess, remove_orphaned_pools


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: no process has this pid now
    return child.pid


def test_the_pools_of_a_dead_launchers_triton_are_removed_and_no_others(tmp_path):
    dead, alive = dead_pid(), os.getpid()
    orphans = [f"{SHM_PREFIX}-{dead}-0a1b2c3d4e5f-{stub}" for stub in ("pre", "engine")]
    kept = [
        f"{SHM_PREFIX}-{alive}-0a1b2c3d4e5f-engine",  # a live launcher's Triton
        f"triton_python_backend_shm_region_{dead}",  # another Triton's, unnamed by us
        "psm_12345678",
    ]
    for name in orphans + kept:
        (tmp_path / name).write_bytes(b"\0" * 16)
    assert sorted(remove_orphaned_pools(tmp_path)) == sorted(orphans)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_each_triton_names_its_pools_after_its_launcher_and_itself(tmp_path):
    first, second = TritonProcess(tmp_path), TritonProcess(tmp_path)
    assert first.shm_prefix.startswith(f"{SHM_PREFIX}-{os.getpid()}-")
    assert first.shm_prefix != second.shm_prefix
