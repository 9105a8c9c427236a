"""The metrics path without Ray: the ingress's figures, the collector's merge, readiness
from Serve's status. The real stack's /metrics: tests/integration/test_production.py."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families
from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

from serve.deployments.ingress import not_running
from serve.deployments.metrics_collector import MetricsCollector, merge
from serve.metrics import MetricsPublisher, RequestMetrics
from tests.conftest import ROOT
from tests.grafana import metric_names, queried_metrics

# What a Triton 2.51 sidecar's /metrics holds (abridged): counters without "_total",
# the engine's custom metrics beside them, and a histogram.
TRITON = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="ensemble",version="1"} 7
nv_inference_request_success{model="tensorrt_llm",version="1"} 7
# HELP nv_inference_pending_request_count Instantaneous number of pending requests
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="ensemble",version="1"} 0
# HELP tritonllm_engine_generated_tokens_total Tokens decoded
# TYPE tritonllm_engine_generated_tokens_total counter
tritonllm_engine_generated_tokens_total{model="tensorrt_llm"} 120
# HELP nv_inference_first_response_histogram_ms Duration from request to first response
# TYPE nv_inference_first_response_histogram_ms histogram
nv_inference_first_response_histogram_ms_bucket{model="ensemble",version="1",le="100"} 6
nv_inference_first_response_histogram_ms_bucket{model="ensemble",version="1",le="+Inf"} 7
nv_inference_first_response_histogram_ms_sum{model="ensemble",version="1"} 412.5
nv_inference_first_response_histogram_ms_count{model="ensemble",version="1"} 7
"""


def families(text: str) -> dict:
    parsed = list(text_string_to_metric_families(text))
    names = [f.name for f in parsed]
    assert len(names) == len(set(names)), "a family's lines are not together"
    return {f.name: f for f in parsed}


def replica(name: str) -> dict[str, str]:
    return {"deployment": "Triton-llm", "replica": name}


def test_the_merge_keeps_names_types_and_exact_values_with_each_process_labelled():
    text = merge([(replica("a"), TRITON), (replica("b"), TRITON.replace(" 7\n", " 9\n"))])
    # Triton's counter keeps its own name (prometheus_client's parser would add _total).
    assert "# TYPE nv_inference_request_success counter\n" in text
    assert text.count("# HELP nv_inference_request_success ") == 1
    assert (
        'nv_inference_request_success{deployment="Triton-llm",replica="b",'
        'model="ensemble",version="1"} 9' in text
    )
    found = families(text)
    assert found["nv_inference_pending_request_count"].type == "gauge"
    assert found["tritonllm_engine_generated_tokens"].type == "counter"
    histogram = found["nv_inference_first_response_histogram_ms"]
    assert histogram.type == "histogram"
    sums = {s.labels["replica"]: s.value for s in histogram.samples if s.name.endswith("_sum")}
    assert sums == {"a": 412.5, "b": 412.5}
    counts = [s for s in histogram.samples if s.name.endswith("_count")]
    assert {s.labels["replica"]: s.value for s in counts} == {"a": 7, "b": 9}


def test_a_family_typed_differently_by_another_process_keeps_the_first_type():
    summary = TRITON.replace(
        "nv_inference_first_response_histogram_ms histogram",
        "nv_inference_first_response_histogram_ms summary",
    )
    found = families(merge([(replica("a"), TRITON), (replica("b"), summary)]))
    histogram = found["nv_inference_first_response_histogram_ms"]
    assert histogram.type == "histogram"
    assert {s.labels["replica"] for s in histogram.samples} == {"a"}
    assert {s.labels["replica"] for s in found["nv_inference_request_success"].samples} == {
        "a",
        "b",
    }


def test_samples_without_labels_or_help_get_the_process_labels():
    text = merge([(replica("a"), 'up 1\nlonely{} 2\nquoted{x="a}b"} 3\n')])
    assert 'up{deployment="Triton-llm",replica="a"} 1' in text
    assert 'lonely{deployment="Triton-llm",replica="a"} 2' in text
    assert 'quoted{deployment="Triton-llm",replica="a",x="a}b"} 3' in text
    assert merge([]) == ""


def test_the_collector_drops_processes_gone_quiet_and_late_pushes():
    now = [100.0]
    collector = MetricsCollector(stale_after_s=10, clock=lambda: now[0])
    run = asyncio.run
    run(collector.push(replica("a"), "x_total 5\n", 2))
    run(collector.push(replica("a"), "x_total 4\n", 1))  # late: an older push
    run(collector.push(replica("b"), "x_total 1\n", 1))
    assert 'replica="a"} 5' in run(collector.render())
    now[0] = 108.0
    run(collector.push(replica("b"), "x_total 2\n", 2))
    now[0] = 111.0  # a: 11 s since its last push
    text = run(collector.render())
    assert 'replica="a"' not in text and 'x_total{deployment="Triton-llm",replica="b"} 2' in text


def test_the_ingress_figures_follow_a_generation_and_keep_their_types():
    metrics = RequestMetrics()
    model = metrics.model("llm")
    assert metrics.model("llm") is model  # bound once per model
    model.started()
    waiting = families(metrics.text())["tritonllm_requests_waiting"].samples
    assert [s.value for s in waiting] == [1]
    model.first_text(0.2)
    model.next_text(0.03)
    model.next_text(0.02)
    model.tokens(5, 3)
    model.ended(had_text=True)
    metrics.model("other").started()
    metrics.model("other").ended(had_text=False)  # failed before any text
    metrics.response("llm", "/v1/completions", 200, 0.4)
    metrics.response("", "/v1/completions", 429, 0.001, tenant="batch")  # refused first
    metrics.response("", "/v1/models", 200, 0.001, tenant="batch")
    text = metrics.text()
    by_tenant = {
        (s.labels["tenant"], s.labels["status"]): s.value
        for s in families(text)["tritonllm_tenant_requests"].samples
        if s.name == "tritonllm_tenant_requests_total"
    }
    assert by_tenant == {("batch", "429"): 1, ("batch", "200"): 1}  # none without a key
    assert "_created" not in text
    found = families(text)
    assert found["tritonllm_requests"].type == "counter"
    assert "# TYPE tritonllm_requests_total counter" in text

    def value(name: str, sample: str, model: str = "llm") -> float:
        (found_value,) = [
            s.value for s in found[name].samples if s.name == sample and s.labels["model"] == model
        ]
        return found_value

    ttft = "tritonllm_time_to_first_token_seconds"
    assert value(ttft, ttft + "_count") == 1
    itl = "tritonllm_inter_token_latency_seconds"
    assert value(itl, itl + "_count") == 2 and abs(value(itl, itl + "_sum") - 0.05) < 1e-9
    assert value("tritonllm_e2e_latency_seconds", "tritonllm_e2e_latency_seconds_sum") == 0.4
    assert value("tritonllm_prompt_tokens", "tritonllm_prompt_tokens_total") == 5
    assert value("tritonllm_generated_tokens", "tritonllm_generated_tokens_total") == 3
    for gauge in ("tritonllm_requests_running", "tritonllm_requests_waiting"):
        assert value(gauge, gauge) == 0 and value(gauge, gauge, "other") == 0


def test_a_publisher_pushes_its_text_with_its_labels_in_order():
    pushed = []

    async def push(labels, text, sequence):
        pushed.append((labels, text, sequence))

    collector = SimpleNamespace(push=SimpleNamespace(remote=push))
    texts = iter(["a 1\n", "a 2\n"])

    async def fetch():
        return next(texts)

    publisher = MetricsPublisher(collector, fetch, replica("r"))

    async def twice():
        await publisher.push()
        await publisher.push()

    asyncio.run(twice())
    assert pushed == [(replica("r"), "a 1\n", 1), (replica("r"), "a 2\n", 2)]


def status(**replica_states) -> ServeStatus:
    deployment = DeploymentStatusOverview(
        status="UPDATING",
        status_trigger="CONFIG_UPDATE_STARTED",
        replica_states=replica_states,
        message="",
    )
    app = ApplicationStatusOverview(
        status="DEPLOYING", message="", last_deployed_time_s=0.0, deployments={"T-llm": deployment}
    )
    return ServeStatus(applications={"app": app})


def test_readiness_wants_a_running_replica_in_serves_own_status():
    handle = SimpleNamespace(app_name="app", deployment_name="T-llm")
    assert not_running(status(RUNNING=1, STARTING=1), handle) is None
    assert not_running(status(STARTING=1), handle) == "no running replica (STARTING: 1)"
    assert not_running(status(), handle) == "no running replica (none)"
    other = SimpleNamespace(app_name="app", deployment_name="T-other")
    assert not_running(status(RUNNING=1), other) == "no deployment"
    assert not_running(ServeStatus(), handle) == "no deployment"


def test_every_metric_the_dashboard_queries_is_documented():
    documented = (ROOT / "docs" / "metrics.md").read_text()
    queried = queried_metrics()
    assert "tritonllm_time_to_first_token_seconds_bucket" in queried  # the parser reads names
    assert "nv_inference_queue_duration_us" in queried
    for name in queried:
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert f"`{family}`" in documented or f"`{name}`" in documented, name


def test_the_dashboard_parser_reads_series_names_only():
    expr = (
        'histogram_quantile(0.9, sum by (le, model) (rate(a_bucket{model=~"$model"}'
        "[$__rate_interval]))) / on (model) group_left b_total offset 5m and c"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
