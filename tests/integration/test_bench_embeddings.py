"""A seconds-long smoke of `make bench-embeddings`: both repositories build, both Tritons
serve, the figures come out (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from bench.embeddings import main

pytestmark = pytest.mark.integration


def test_the_benchmark_runs_both_repositories_and_writes_its_figures(
    built_embedding_repository, tmp_path
):
    args = ["--concurrency", "1,4", "--requests-per-client", "1", "--rounds", "2"]
    args += ["--scratch", str(tmp_path)]
    assert main([*args, "--preferred-batch-sizes", "2,4"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    runs = {(run["name"], run["concurrency"]): run for run in results["runs"]}
    assert set(runs) == {(n, c) for n in ("batching on", "batching off") for c in (1, 4)}
    assert all(
        run["errors"] == 0 and run["requests"] == 2 * run["concurrency"] for run in runs.values()
    )
    # Without a dynamic batcher every request is its own execute.
    assert runs["batching off", 4]["mean_batch"] == 1.0
    config = "embeddings/config.pbtxt"
    assert "preferred_batch_size: [ 2, 4 ]" in (tmp_path / "batching-on" / config).read_text()
    assert "dynamic_batching {" not in (tmp_path / "batching-off" / config).read_text()
