"""make bench-capacity's own logic: CPU per token by role, its targets, its Serve config
(the benchmark itself is a tool: tests/integration/test_bench_capacity.py runs a smoke)."""

from __future__ import annotations

import pytest

from bench.capacity import check_targets, cpu_figures, saturation, stack_config
from serve.config import AppConfig


def level(system, concurrency, tokens_per_s, cpu_s, step_ms=5.0, ttft=100.0, seconds=10.0):
    return {"system": system, "concurrency": concurrency, "step_ms": step_ms,
            "output_tokens_per_s": tokens_per_s, "seconds": seconds, "ttft_p50_ms": ttft,
            "cpu_s": cpu_s}  # fmt: skip


def test_cpu_per_token_counts_each_systems_own_processes_and_keeps_the_client_apart():
    spent = {"engine": 1.0, "ingress replica": 2.0, "triton:engine": 5.0, "load generator": 3.0}
    stack = level("stack", 64, 100.0, spent)
    figures = cpu_figures(stack, "stack")  # 1,000 tokens
    assert figures["serving_ms_per_token"] == pytest.approx(3.0)  # engine + ingress
    assert figures["cpu_ms_per_token"]["load generator"] == pytest.approx(3.0)
    assert figures["serving_cores"] == pytest.approx(0.3)
    alone = cpu_figures(level("triton", 64, 100.0, spent), "triton")
    assert alone["serving_ms_per_token"] == pytest.approx(5.0)  # triton:engine only


def test_targets_compare_the_stack_at_256_streams_and_where_triton_leaves_half_idle():
    results = []
    for system, tokens_per_s, cpu_s, ttft in (
        ("triton", 1000.0, {"triton:engine": 2.0}, 100.0),  # 0.2 cores: compared
        ("stack", 950.0, {"engine": 1.0, "ingress replica": 0.85}, 110.0),
    ):
        for c in (64, 256):
            results.append(level(system, c, tokens_per_s, cpu_s, ttft=ttft))
    busy = {"triton:engine": 12.0}  # 1.2 of 2 cores: compared at 256 streams only
    results += [level("triton", c, 1000.0, busy, step_ms=1.0) for c in (64, 256)]
    results += [level("stack", c, 800.0, {"engine": 1.0}, step_ms=1.0) for c in (64, 256)]
    for r in results:
        r |= cpu_figures(r, r["system"])
    checks = {c["name"]: c for c in check_targets(results, cores=2)}
    assert checks["stack serving CPU ms/token, 256 streams, step 5 ms"]["pass"]  # 0.195
    assert checks["stack/triton tokens/s, step 5 ms, 256 streams"]["value"] == 0.95
    assert checks["TTFT p50 added, step 5 ms, 64 streams"]["pass"]
    assert not checks["stack/triton tokens/s, step 1 ms, 256 streams"]["pass"]  # 0.8
    assert "stack/triton tokens/s, step 1 ms, 64 streams" not in checks
    best = saturation(results)
    assert {(b["system"], b["step_ms"], b["tokens_per_s"]) for b in best} == {
        ("triton", 5.0, 1000),
        ("stack", 5.0, 950),
        ("triton", 1.0, 1000),
        ("stack", 1.0, 800),
    }


def test_the_stacks_config_has_room_for_every_stream(tmp_path):
    config = stack_config(
        tmp_path, 8123, max_concurrency=512, stream_interval_ms=50, stream_chunks_per_s=0
    )
    args = AppConfig.model_validate(config["applications"][0]["args"])
    (model,) = args.models
    assert (model.deployment.max_ongoing_requests, model.deployment.max_queued_requests) == (
        512,
        512,
    )
    assert model.deployment.num_replicas == 1 and model.stream_interval_ms == 50
    assert model.stream_chunks_per_s == 0
    assert config["http_options"]["port"] == 8123
