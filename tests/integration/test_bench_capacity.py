"""A tiny smoke of ``make bench-capacity`` end to end, to keep the tool working: Triton
alone and the stack over the null engine at a trivial size. It checks the report's
shape, never its figures. And a SIGTERM mid-run stops the stack it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import ROOT
from tests.processes import listener_sockets, listening_inodes, processes_with_env

pytestmark = pytest.mark.integration


def test_the_capacity_benchmark_runs_both_systems_over_the_null_engine(tmp_path):
    out = tmp_path / "capacity"
    command = [sys.executable, "-m", "bench.capacity", "--concurrency", "4", "--output-len", "8"]
    command += ["--requests-per-client", "1", "--max-batch-size", "8", "--out", str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    data = json.loads((out / "results.json").read_text())
    assert {(lv["system"], lv["concurrency"]) for lv in data["levels"]} == {
        ("triton", 4),
        ("stack", 4),
    }
    for lv in data["levels"]:
        assert lv["errors"] == 0 and lv["completed"] == 4, lv
        assert lv["step_ms"] == 5.0 and lv["tokens_per_chunk"] >= 1
        assert lv["serving_ms_per_token"] is None or lv["serving_ms_per_token"] > 0
    assert {r["system"] for r in data["saturation"]} == {"triton", "stack"}
    assert "CPU ms per streamed token" in run.stdout  # the tables, printed last


def test_sigterm_to_the_capacity_benchmark_stops_its_stack_and_frees_its_ports(tmp_path):
    # As `docker stop`, systemd or a kill of `make bench-capacity`'s process group: the
    # stack it runs in a session of its own must not outlive it.
    mark = f"TRITONLLM_BENCH_SIGTERM={uuid.uuid4().hex}"
    command = [sys.executable, "-m", "bench.capacity", "--concurrency", "2", "--output-len", "8"]
    command += ["--requests-per-client", "2000", "--max-batch-size", "8", "--systems", "stack"]
    command += ["--out", str(tmp_path / "capacity")]
    env = os.environ | dict([mark.split("=", 1)])
    bench = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while True:  # the stack up: its HAProxy and its Triton
            running = processes_with_env(mark.encode())
            if {"haproxy", "tritonserver"} <= {k for c in running.values() for k in _kinds(c)}:
                break
            assert bench.poll() is None and time.monotonic() < deadline, running
            time.sleep(1)
        sockets = {i: a for pid in running for i, a in _sockets(pid).items()}
        assert sockets, running
        os.killpg(bench.pid, signal.SIGTERM)
        started = time.monotonic()
        while (left := processes_with_env(mark.encode())) and time.monotonic() - started < 60:
            time.sleep(0.5)
        took = time.monotonic() - started
        assert not left, f"still running {took:.0f} s after SIGTERM: {left}"
        assert bench.wait(10) != 0  # interrupted, not finished
        still = sorted(sockets[inode] for inode in set(sockets) & listening_inodes())
        assert not still, f"sockets still listening after SIGTERM: {still}"
        print(f"stack stopped {took:.1f} s after SIGTERM, {len(sockets)} sockets closed")
    finally:
        for pid in processes_with_env(mark.encode()):
            os.kill(pid, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
        bench.wait()


def _kinds(command: str) -> set[str]:
    return {k for k in ("haproxy", "tritonserver", "raylet") if k in command}


def _sockets(pid: int) -> dict[str, tuple[str, int]]:
    try:
        return listener_sockets(pid)
    except OSError:  # gone meanwhile
        return {}


def test_the_replica_client_benchmark_reports_its_cpu_per_request():
    command = [sys.executable, "-m", "bench.replica_client", "--concurrency", "4"]
    command += ["--requests", "8", "--rounds", "2"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rounds = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rounds) == 2
    for figures in rounds:
        assert figures["cpu_ms_per_request"] > 0 and figures["wall_s"] > 0
        assert figures["errors"] == 0
        assert 1 <= figures["chunks_per_request"] <= 64  # 64 tokens, in one chunk or more
