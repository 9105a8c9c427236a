"""Prometheus metrics through Ray's metrics system (one scrape target per Ray node).

Ray exports every metric below with a ``ray_`` prefix on each node's metrics export
port, tagged by Serve with ``application``, ``deployment`` and ``replica``:

- the ingress records the request-level figures (:class:`RequestMetrics`);
- each Triton replica re-exports its own Triton's metrics (:class:`TritonMetricsExporter`),
  because a sidecar Triton's metrics port is bound to loopback and an in-process
  Triton opens none.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable

from prometheus_client.parser import text_string_to_metric_families
from ray.serve.metrics import Counter, Gauge, Histogram

log = logging.getLogger("ray.serve")

# Seconds: from a few ms (a cached short answer) to minutes (a long CPU generation).
_LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
_TOKEN_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28]


class RequestMetrics:
    """The front door's figures, by model (and status for the request count)."""

    def __init__(self):
        by_model = ("model",)
        self.requests = Counter(
            "tritonllm_requests",
            "HTTP requests answered, by model, route and status code",
            tag_keys=("model", "route", "status"),
        )
        self.ongoing = Gauge(
            "tritonllm_ongoing_generations",
            "generations this ingress is waiting on (streams open to replicas)",
            by_model,
        )
        self.time_to_first_token = Histogram(
            "tritonllm_time_to_first_token_seconds",
            "from the ingress sending a request to a replica to its first generated text",
            _LATENCY_BOUNDARIES,
            by_model,
        )
        self.inter_token_latency = Histogram(
            "tritonllm_inter_token_latency_seconds",
            "between consecutive streamed chunks of one answer",
            _TOKEN_BOUNDARIES,
            by_model,
        )
        self.e2e_latency = Histogram(
            "tritonllm_e2e_latency_seconds",
            "from the request's arrival to its last byte",
            _LATENCY_BOUNDARIES,
            by_model,
        )
        self.prompt_tokens = Counter("tritonllm_prompt_tokens", "prompt tokens", by_model)
        self.generated_tokens = Counter("tritonllm_generated_tokens", "generated tokens", by_model)
        self._ongoing: dict[str, int] = {}

    def generation_started(self, model: str) -> None:
        self._ongoing[model] = self._ongoing.get(model, 0) + 1
        self.ongoing.set(self._ongoing[model], {"model": model})

    def generation_ended(self, model: str) -> None:
        self._ongoing[model] = max(self._ongoing.get(model, 1) - 1, 0)
        self.ongoing.set(self._ongoing[model], {"model": model})

    def text_arrived(self, model: str, seconds: float, first: bool) -> None:
        """A chunk with text, ``seconds`` after the request was sent (first) or after
        the previous text."""
        histogram = self.time_to_first_token if first else self.inter_token_latency
        histogram.observe(seconds, {"model": model})

    def response(self, model: str, route: str, status: int, seconds: float) -> None:
        self.requests.inc(1, {"model": model, "route": route, "status": str(status)})
        if model:
            self.e2e_latency.observe(seconds, {"model": model})

    def tokens(self, model: str, prompt: int, generated: int) -> None:
        if prompt:
            self.prompt_tokens.inc(prompt, {"model": model})
        if generated:
            self.generated_tokens.inc(generated, {"model": model})


_NAME = re.compile(r"[^a-zA-Z0-9_]")


class TritonMetricsExporter:
    """Re-exports a Triton's Prometheus text as Ray gauges named ``triton_<name>``.

    Counters become gauges holding Triton's running total (``rate()`` works on them
    as on the original); histograms and summaries keep their ``_sum``/``_count``/
    ``_bucket`` samples the same way.
    """

    def __init__(self, fetch: Callable[[], Awaitable[str]], period_s: float = 5.0):
        self._fetch = fetch
        self._period_s = period_s
        self._gauges: dict[str, Gauge] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                self.export(await self._fetch())
            except Exception as error:  # a dead Triton must not kill the exporter
                log.warning("could not read Triton's metrics: %s", error)
            await asyncio.sleep(self._period_s)

    def export(self, text: str) -> int:
        """Set one gauge per sample of ``text``; returns how many were set."""
        count = 0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = "triton_" + _NAME.sub("_", sample.name)
                tags = {_NAME.sub("_", k): v for k, v in sample.labels.items()}
                self._gauge(name, family.documentation, tuple(sorted(tags))).set(sample.value, tags)
                count += 1
        return count

    def _gauge(self, name: str, documentation: str, tag_keys: tuple[str, ...]) -> Gauge:
        key = f"{name}{tag_keys}"
        if key not in self._gauges:
            self._gauges[key] = Gauge(name, documentation or name, tag_keys)
        return self._gauges[key]
