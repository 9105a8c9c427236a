"""A tiny smoke of ``make bench-structured`` end to end, to keep the tool working: both
conditions over the default model, two streams, one round, a few tokens. It checks the
report's shape, never its figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_the_structured_benchmark_runs_both_conditions_and_times_the_compile(
    built_repository, tmp_path
):
    out = tmp_path / "structured"
    command = [sys.executable, "-m", "bench.structured", "--repository", str(built_repository)]
    command += ["--streams", "2", "--requests-per-stream", "1", "--rounds", "1"]
    command += ["--max-tokens", "8", "--compile-repeats", "1", "--out", str(out)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    data = json.loads((out / "results.json").read_text())
    assert [c["condition"] for c in data["conditions"]] == ["free", "json_schema"]
    for condition in data["conditions"]:
        assert condition["errors"] == 0 and condition["completed"] == 2, condition
        assert 0 < condition["tokens_per_answer"] <= 8
        assert {"stop_share", "json_share", "schema_valid_share", "itl_p50_ms"} <= set(condition)
    assert [(r["round"], r["condition"]) for r in data["rounds"]] == [
        (0, "free"),
        (0, "json_schema"),
    ]
    assert {"tokens_per_s", "itl_p50"} <= set(data["ratios"]) and len(data["targets"]) == 2
    generated, person = data["compile"]
    assert generated["fields"] == 20 and person["fields"] == len(data["schema"]["properties"])
    assert all(c["cold_ms"] > 0 and c["cached_ms"] > 0 for c in data["compile"])
    assert all(text.startswith("{") for text in data["examples"]["json_schema"])
    assert "tok/answer" in run.stdout  # the table, printed last
