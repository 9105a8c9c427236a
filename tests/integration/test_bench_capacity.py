"""A tiny smoke of ``make bench-capacity`` end to end, to keep the tool working: Triton
alone and the stack over the null engine at a trivial size. It checks the report's
shape, never its figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

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
