"""``make soak``: mixed traffic against a two-node Ray cluster for a fixed time, then checks.

``python -m tests.soak [--minutes 10] [--out build/soak/results.json]``. A head and one
worker node on this machine (tests/integration/cluster.py), the shipped serve/config.yaml
with the LLM on two replicas behind a small queue bound and the embeddings model beside
it, then every request class of tests/soak_traffic.py at once: a warm-up, the run, and
at the end these checks:

- no request hung (each has a timeout) and every answer had its class's status, the
  only 5xx being the documented 503 with ``Retry-After`` of a full queue;
- the bursts did reach past the queue bound (some 503s), and every class got answers;
- once traffic stops, every engine slot and Triton in-flight request is released (the
  app's /metrics: the gauges below back to 0);
- the resident memory (VmRSS) of each process of the cluster (Ray's, the replicas',
  each Triton and its Python backend stubs) grew by at most 10% from warm-up to the end.

Writes a JSON result and prints tables; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from serve.deploy_config import load_base
from serve.metrics import PUSH_PERIOD_S
from tests.conftest import ROOT, build_embedding_repository, build_repository
from tests.integration.cluster import RayCluster
from tests.integration.test_production import TRITON, app_metrics, metric_values
from tests.soak_rss import rss_growth, rss_snapshot
from tests.soak_traffic import CLASSES, EXPECTED, RETRYABLE, Outcome, Traffic, expected

# The LLM's queue bound: 2 replicas x 4 running, 4 more queued in the ingress's router,
# so a burst of 24 beside the steady clients is refused in part (the documented 503).
LLM_DEPLOYMENT = {
    "autoscaling_config": None,
    "num_replicas": 2,
    "max_ongoing_requests": 4,
    "max_queued_requests": 4,
}
EMBEDDINGS = "Triton-all-MiniLM-L6-v2"
# Gauges that count work in flight: all back to 0 once traffic stops, or a slot leaked.
IN_FLIGHT_GAUGES = (
    "tritonllm_engine_running_sequences",
    "tritonllm_engine_queued_requests",
    "tritonllm_requests_running",
    "tritonllm_requests_waiting",
    "nv_inference_pending_request_count",
)


def soak_config() -> dict:
    """serve/config.yaml's two models over the built repositories, the LLM bounded."""
    config = load_base()
    llm, embeddings = config["applications"][0]["args"]["models"]
    llm["triton"]["model_repository"] = str(build_repository())
    llm["deployment"].update(LLM_DEPLOYMENT)
    embeddings["triton"]["model_repository"] = str(build_embedding_repository())
    return config


def start(cluster: RayCluster) -> None:
    """The head and a worker with 3 CPUs, the app deployed: the two LLM replicas (0.75
    CPU each) and the embeddings one (0.5) cannot all fit on a 1-CPU head, so requests
    cross nodes."""
    cluster.start()
    cluster.add_node("worker-1", num_cpus=3)
    cluster.deploy(soak_config())
    cluster.wait_running()


def placement(cluster: RayCluster) -> dict[str, list[str]]:
    """Each deployment's RUNNING replicas, by node (``head`` or a worker's name)."""
    workers = {node.name for node in cluster.nodes}
    node = {id: name if name in workers else "head" for id, name in cluster.node_names().items()}
    return {
        name: sorted(node[r["node_id"]] for r in cluster.running_replicas("llm", name))
        for name in cluster.applications()["llm"]["deployments"]
    }


def check(name: str, ok: bool, detail: str = "") -> dict:
    return {"check": name, "ok": bool(ok), "detail": detail}


def placement_checks(where: dict[str, list[str]]) -> list[dict]:
    llm, embeddings = where.get(TRITON, []), where.get(EMBEDDINGS, [])
    nodes = {node for replicas in where.values() for node in replicas}
    return [
        check("two LLM replicas running", len(llm) == 2, f"on {llm}"),
        check("the embeddings replica running", len(embeddings) == 1, f"on {embeddings}"),
        check("replicas on both nodes", len(nodes) == 2, str(where)),
    ]


def traffic_checks(outcomes: list[Outcome], hanging: int) -> list[dict]:
    unexpected = [o for o in outcomes if not expected(o)]
    by_kind = Counter((o.kind, o.status) for o in outcomes)
    kinds = {*CLASSES, "burst"}
    answered = {k for k in kinds if by_kind[(k, str(EXPECTED.get(k, 200)))] > 0}
    refused, bursts = by_kind[("burst", RETRYABLE)], sum(o.kind == "burst" for o in outcomes)
    return [
        check("no client still in a request", hanging == 0, f"{hanging} hanging"),
        check(
            "every status expected (the only 5xx: 503 with Retry-After)",
            not unexpected,
            "; ".join(f"{o.kind} {o.status} {o.detail}" for o in unexpected[:5]),
        ),
        check("every class answered", answered == kinds, ", ".join(sorted(kinds - answered))),
        check("bursts refused in part with 503", refused > 0, f"{refused} of {bursts}"),
    ]


def in_flight(url: str) -> dict[str, float]:
    """Each in-flight gauge summed over every process's samples (absent: missing)."""
    text = app_metrics(url)
    return {
        name: sum(value for _, value in samples)
        for name in IN_FLIGHT_GAUGES
        if (samples := metric_values(text, name))
    }


def released_check(url: str, timeout_s: float = 30) -> dict:
    """The gauges once traffic has stopped: after one push period (every process
    pushes its figures that often) they must read 0 within ``timeout_s``."""
    time.sleep(PUSH_PERIOD_S + 1)
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = in_flight(url)
        released = set(gauges) == set(IN_FLIGHT_GAUGES) and not any(gauges.values())
        if released or time.monotonic() > deadline:
            return check("every engine slot and Triton request released", released, str(gauges))
        time.sleep(1)


def soak(cluster: RayCluster, minutes: float, warmup_s: float) -> dict:
    where = placement(cluster)
    with Traffic(cluster.url) as traffic:
        time.sleep(warmup_s)
        warm = rss_snapshot(cluster)
        time.sleep(minutes * 60)
        end = rss_snapshot(cluster)  # under the same load as ``warm``
        hanging = traffic.stop()
    rss, rss_checks = rss_growth(warm, end)
    return {
        "minutes": minutes,
        "warmup_s": warmup_s,
        "placement": where,
        "requests": summary(traffic.outcomes),
        "rss": rss,
        "checks": [
            *placement_checks(where),
            *traffic_checks(traffic.outcomes, hanging),
            released_check(cluster.url),
            *rss_checks,
        ],
    }


def summary(outcomes: list[Outcome]) -> dict[str, dict]:
    """Per class: the count of each status, and p50/p99 latency of the expected ones."""
    classes = {}
    for kind in sorted({o.kind for o in outcomes}):
        mine = [o for o in outcomes if o.kind == kind]
        latencies = sorted(o.latency_s for o in mine if expected(o))
        classes[kind] = {
            "statuses": dict(Counter(o.status for o in mine)),
            "p50_s": percentile(latencies, 0.50),
            "p99_s": percentile(latencies, 0.99),
        }
    return classes


def percentile(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10, help="the run, after warm-up")
    parser.add_argument(
        "--warmup-s",
        type=float,
        help="traffic before the first memory reading (default: "
        "60 s for a run of 5 minutes or more, else 25 s)",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "build" / "soak" / "results.json", help="JSON result"
    )
    args = parser.parse_args(argv)
    warmup_s = args.warmup_s if args.warmup_s is not None else (60 if args.minutes >= 5 else 25)
    started = time.monotonic()
    cluster = RayCluster(num_cpus=1)
    try:  # a cluster that fails to start or deploy is stopped too
        start(cluster)
        result = soak(cluster, args.minutes, warmup_s)
    finally:
        cluster.stop()
    result["passed"] = all(c["ok"] for c in result["checks"])
    result["wall_s"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_report(result)
    print(f"results: {args.out}")
    return 0 if result["passed"] else 1


def print_report(result: dict) -> None:
    console = Console(soft_wrap=True, width=132)
    console.print(requests_table(result["requests"]))
    console.print(rss_table(result["rss"]))
    checks = Table(title=f"soak of {result['minutes']} min after {result['warmup_s']} s warm-up")
    for column in ("check", "ok", "detail"):
        checks.add_column(column)
    for c in result["checks"]:
        checks.add_row(c["check"], "ok" if c["ok"] else "[red]FAILED[/red]", c["detail"])
    console.print(checks)
    console.print("[green]PASSED[/green]" if result["passed"] else "[red]FAILED[/red]")


def requests_table(requests: dict[str, dict]) -> Table:
    table = Table(title="requests by class (latency of the expected answers)")
    for column in ("class", "statuses", "p50 s", "p99 s"):
        table.add_column(column, justify="left" if column != "p50 s" else "right")
    for kind, figures in requests.items():
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(figures["statuses"].items()))
        table.add_row(kind, statuses, str(figures["p50_s"]), str(figures["p99_s"]))
    return table


def rss_table(rows: list[dict]) -> Table:
    table = Table(title="resident memory (VmRSS, MiB): after warm-up, at the end")
    for column in ("process", "node", "pid", "warm", "end", "growth %"):
        table.add_column(column, justify="left" if column in ("process", "node") else "right")
    for row in rows:
        end = "ended" if row["end_kib"] is None else f"{row['end_kib'] / 1024:.1f}"
        growth = "" if row["growth_pct"] is None else f"{row['growth_pct']:+.1f}"
        if row["over"]:
            growth = f"[red]{growth}[/red]"
        table.add_row(
            row["process"],
            row["node"],
            str(row["pid"]),
            f"{row['warm_kib'] / 1024:.1f}",
            end,
            growth,
        )
    return table


if __name__ == "__main__":
    sys.exit(main())
