"""A tiny smoke of ``make bench`` end to end, to keep the tool working.

The benchmark is a tool, not a test: this runs it at a trivial size (two levels, a
few 4-token answers) over the default model and checks the report's shape, never
its figures.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

FIELDS = {
    "system",
    "concurrency",
    "requests",
    "completed",
    "errors",
    "rejected_503",
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
}


def test_the_serving_benchmark_runs_all_three_systems_and_writes_its_report(
    built_repository, tmp_path
):
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "bench.serving", "--repository", str(built_repository)]
    command += ["--concurrency", "1,2", "--output-len", "4", "--requests-per-client", "1"]
    command += ["--min-requests", "2", "--out", str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    data = json.loads((out / "results.json").read_text())
    systems = {(level["system"], level["concurrency"]) for level in data["levels"]}
    assert systems == {(s, c) for s in ("pipeline", "triton", "stack") for c in (1, 2)}
    for level in data["levels"]:
        assert FIELDS <= level.keys(), FIELDS - level.keys()
        assert level["errors"] == 0 and level["completed"] == level["requests"], level
    stack = [level for level in data["levels"] if level["system"] == "stack"]
    # CPU by role is read from /proc in 10 ms ticks: a 4-token level may show none.
    assert any("engine" in level["cpu_s"] for level in stack)
    assert all("front_door_cpu_ms_per_token" in level for level in stack)
    assert [row["concurrency"] for row in data["ratios"]] == [1, 2]
    assert {"stack_over_pipeline", "stack_over_triton", "ttft_p50_added_ms"} <= set(
        data["ratios"][0]
    )
    assert data["targets"] and data["machine"]["cores"] and data["command"]
    assert (out / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "out tok/s" in run.stdout  # the table, printed last
