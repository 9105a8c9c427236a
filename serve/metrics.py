"""Prometheus metrics of the whole application, served by ``GET /metrics`` on the API port.

docs/metrics.md lists every metric. Where they come from:

- each ingress replica records the request-level figures (:class:`RequestMetrics`) in a
  ``prometheus_client`` registry of its own;
- each Triton replica's Triton exports its own metrics (``nv_*``, the TensorRT-LLM
  backend's ``nv_trt_llm_*``, the engine's custom ``tritonllm_engine_*``) on a
  loopback port (sidecar) or through the in-process API;
- every one of these processes pushes its Prometheus text to the app's
  :class:`serve.deployments.metrics_collector.MetricsCollector` every few seconds
  (:class:`MetricsPublisher`), which merges the latest text of each live process, with
  the process's ``deployment`` and ``replica`` as labels, into one exposition.

Why a collector (and not a registry per ingress replica, nor Ray's metrics export).
The API port is load-balanced over N ingress replicas on several nodes:

- A registry per ingress replica answering ``/metrics`` itself would show each scrape
  a different replica's counters: the series would jump up and down between scrapes.
- Ray's metrics (``ray.serve.metrics``) are exported per node, so ``/metrics`` would
  have to fetch every node's export port (found with ``ray.nodes()``) and filter a
  300 KB text per node per scrape. Worse, Ray cannot carry Triton's own metrics with
  their types: its API has no way to set a counter's total or a histogram's buckets
  (this module used to re-export Triton's counters as Ray gauges), and Ray 2.60's
  OpenTelemetry export writes a histogram's ``_sum`` from bucket midpoints, not from
  the observed values, so a mean latency read from it is wrong.
- The collector keeps, per live process, the last text that process pushed. Each
  series is that process's own cumulative value, labelled by ``replica``, so it is
  monotonic whichever ingress replica answers the scrape (they all read the one
  collector); a process that ends stops pushing and its series leave the exposition
  (``STALE_AFTER_S``), as a restarted process's new series begin at zero, which is
  how Prometheus' ``rate()`` expects counters to behave. Nothing is summed across
  processes here (a sum would drop when a replica leaves): dashboards sum in PromQL.
  Types, help texts and exact histogram sums pass through untouched. The collector
  is a Serve deployment of the app (one replica, no CPU reserved): Serve restarts it
  if it dies, after which every process's next push restores the whole view.
- The cost on the token path is one ``observe`` on a label-bound ``prometheus_client``
  histogram per streamed chunk: 3 us where Ray's ``Histogram.observe`` took 10 us
  (measured side by side in one Ray actor on the 2-core CI box).

Figures are at most ``PUSH_PERIOD_S`` late, well under a usual scrape interval.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("ray.serve")

# How often each process sends its metrics to the collector.
PUSH_PERIOD_S = 5.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: from a few ms (a cached short answer) to minutes (a long CPU generation).
_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
_TOKEN_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28]


# The figures of the request routers in this process (serve/routing/kv_aware.py): Serve
# runs a model's router in each process that holds a handle to it, the ingress here.
ROUTING_REGISTRY = CollectorRegistry(auto_describe=False)


class ModelMetrics:
    """One model's figures, bound to its label once (a labelled lookup per chunk would
    cost a dict lookup and a lock more): what a generation records as it goes."""

    def __init__(self, metrics: RequestMetrics, model: str):
        self.running = metrics.running.labels(model)
        self.waiting = metrics.waiting.labels(model)
        self.time_to_first_token = metrics.time_to_first_token.labels(model)
        self.inter_token_latency = metrics.inter_token_latency.labels(model)
        self.prompt_tokens = metrics.prompt_tokens.labels(model)
        self.generated_tokens = metrics.generated_tokens.labels(model)
        self._migrations = {o: metrics.migrations.labels(model, o) for o in ("resumed", "refused")}

    def started(self) -> None:
        self.waiting.inc()

    def first_text(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        self.waiting.dec()
        self.running.inc()

    def next_text(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def ended(self, had_text: bool) -> None:
        (self.running if had_text else self.waiting).dec()

    def tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(generated)

    def migration(self, outcome: str) -> None:
        """A lost replica's generation ``resumed`` elsewhere, or ``refused`` (failed)."""
        self._migrations[outcome].inc()


class RequestMetrics:
    """The front door's figures (one per ingress replica), by model."""

    def __init__(self):
        self.registry = registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "tritonllm_requests",
            "HTTP requests answered, by model, route and status code (499: client left)",
            ("model", "route", "status"),
            registry=registry,
        )
        self.tenant_requests = Counter(
            "tritonllm_tenant_requests",
            "HTTP requests an API key let in, by its tenant (a named one, or default for "
            "the plain keys) and status code (429: past its rate limit)",
            ("tenant", "status"),
            registry=registry,
        )
        self.tenant_tokens = Counter(
            "tritonllm_tenant_tokens",
            "tokens of the generations and embeddings an API key asked for, by its tenant "
            "and kind (prompt, completion; the engines' own counts)",
            ("tenant", "kind"),
            registry=registry,
        )
        self.tenant_queue = Histogram(
            "tritonllm_tenant_queue_seconds",
            "how long a request waited in the ingress for its fair share of the model's "
            "engines (0: a seat was free), by tenant (default: plain keys, open API) and "
            "model",
            ("tenant", "model"),
            registry=registry,
            buckets=[0.0, *_LATENCY_BOUNDARIES],
        )
        self._declare_generation_figures(registry)
        self._models: dict[str, ModelMetrics] = {}

    def _declare_generation_figures(self, registry: CollectorRegistry) -> None:
        """Each model's generations: in flight, their latencies, tokens and migrations."""
        by_model = ("model",)
        self.running = Gauge(
            "tritonllm_requests_running",
            "generations that have streamed their first text and not ended",
            by_model,
            registry=registry,
        )
        self.waiting = Gauge(
            "tritonllm_requests_waiting",
            "generations sent to a model's replicas that have no text yet "
            "(queued in Serve, Triton or the engine, or in prefill)",
            by_model,
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "tritonllm_time_to_first_token_seconds",
            "from the ingress sending a generation to its replicas to its first text",
            by_model,
            registry=registry,
            buckets=_LATENCY_BOUNDARIES,
        )
        self.inter_token_latency = Histogram(
            "tritonllm_inter_token_latency_seconds",
            "between consecutive streamed chunks of text of one generation",
            by_model,
            registry=registry,
            buckets=_TOKEN_BOUNDARIES,
        )
        self.e2e_latency = Histogram(
            "tritonllm_e2e_latency_seconds",
            "from a model's request arriving to its response's last byte",
            by_model,
            registry=registry,
            buckets=_LATENCY_BOUNDARIES,
        )
        self.prompt_tokens = Counter(
            "tritonllm_prompt_tokens",
            "prompt tokens of finished generations",
            by_model,
            registry=registry,
        )
        self.generated_tokens = Counter(
            "tritonllm_generated_tokens",
            "tokens generated by finished generations",
            by_model,
            registry=registry,
        )
        self.migrations = Counter(
            "tritonllm_request_migrations",
            "generations whose replica was lost: resumed on another replica, or refused "
            "(past max_migrations, or a request that cannot continue exactly)",
            ("model", "outcome"),
            registry=registry,
        )

    def model(self, model: str) -> ModelMetrics:
        """The figures of ``model`` (a configured model id or variant: bounded)."""
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(self, model)
        return found

    def response(
        self, model: str, route: str, status: int, seconds: float, tenant: str | None = None
    ) -> None:
        """``tenant``: that of the key that let the request in (None: no key needed,
        or none let it in)."""
        self.requests.labels(model, route, str(status)).inc()
        if tenant is not None:
            self.tenant_requests.labels(tenant, str(status)).inc()
        if model:
            self.e2e_latency.labels(model).observe(seconds)

    def queue_wait(self, model: str) -> Callable[[str, float], None]:
        """What a model's fair queue calls with each request's wait for its seat."""
        histogram = self.tenant_queue
        return lambda tenant, seconds: histogram.labels(tenant, model).observe(seconds)

    def text(self) -> str:
        """This registry's Prometheus text, without the ``<name>_created`` gauges that
        ``prometheus_client`` adds to it (creation times, not figures)."""
        text = generate_latest(self.registry).decode() + generate_latest(ROUTING_REGISTRY).decode()
        return "".join(line for line in text.splitlines(True) if not _CREATED.match(line))


_CREATED = re.compile(r"(# (HELP|TYPE) )?\w+_created[ {]")


class MetricsPublisher:
    """Pushes ``fetch()``'s Prometheus text to the collector every ``period_s``, with
    ``labels`` naming this process (its Serve deployment and replica)."""

    def __init__(
        self,
        collector,  # DeploymentHandle of the MetricsCollector
        fetch: Callable[[], Awaitable[str]],
        labels: dict[str, str],
        period_s: float = PUSH_PERIOD_S,
    ):
        self._collector = collector
        self._fetch = fetch
        self._labels = labels
        self._period_s = period_s
        self._sequence = 0  # a late push must not replace a newer one
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                await self.push()
            except Exception as error:  # a dead Triton or collector must not end the loop
                log.warning("could not publish metrics: %s", error)
            await asyncio.sleep(self._period_s)

    async def push(self) -> None:
        text = await self._fetch()
        self._sequence += 1
        response = self._collector.push.remote(self._labels, text, self._sequence)
        await asyncio.wait_for(response, self._period_s)


def replica_labels() -> dict[str, str]:
    """``deployment`` and ``replica`` of the Serve replica this runs in."""
    from ray import serve

    context = serve.get_replica_context()
    return {"deployment": context.deployment, "replica": context.replica_id.unique_id}
