"""The engine's own metrics through Triton's custom metrics API (pb_utils passed in).

They appear on Triton's metrics endpoint next to Triton's own ``nv_*`` metrics.
The prefix cache's counters carry vLLM's names as vLLM's endpoint shows them
(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``: prompt tokens
looked up and found), so dashboards and autoscalers written for vLLM read them as is.
Each update is a message from the Python stub to the server, so the observer
aggregates steps and flushes at most every ``flush_interval_s``, keeping that
traffic out of the decode loop.
"""

from __future__ import annotations

import time

from tritonllm.engine.scheduler import StepStats

# The guides (structured outputs) whose requests stopped waiting for their compile.
_GUIDE_COUNTERS = (
    (
        "tritonllm_engine_guides_compiled_total",
        "Guided requests whose guide compiled (at once from XGrammar's cache when seen before)",
        lambda g: g.compiled,
    ),
    (
        "tritonllm_engine_guide_compile_seconds_total",
        "Time the compile workers spent on those guides",
        lambda g: g.compile_seconds,
    ),
    (
        "tritonllm_engine_guide_wait_seconds_total",
        "Time guided requests waited in the queue for their guide, compiled or refused",
        lambda g: g.wait_seconds,
    ),
    (
        "tritonllm_engine_guides_refused_total",
        "Guided requests refused once their guide was tried: XGrammar could not compile it, "
        "or its compile passed guide_compile_timeout_s",
        lambda g: g.refused,
    ),
    (
        "tritonllm_engine_guide_compile_timeouts_total",
        "Of those, the guides whose compile passed guide_compile_timeout_s",
        lambda g: g.too_slow,
    ),
)


class EngineMetrics:
    def __init__(self, pb_utils, model: str, flush_interval_s: float = 0.25):
        family = pb_utils.MetricFamily
        self._families = []  # a family must outlive its metrics

        def metric(name, description, kind):
            self._families.append(family(name=name, description=description, kind=kind))
            return self._families[-1].Metric(labels={"model": model})

        self._running = metric(
            "tritonllm_engine_running_sequences", "Sequences in the running batch", family.GAUGE
        )
        self._queued = metric(
            "tritonllm_engine_queued_requests", "Requests waiting for a slot", family.GAUGE
        )
        self._prompt_tokens = metric(
            "tritonllm_engine_prompt_tokens_total",
            "Prompt tokens prefilled (computed: cached prefixes are not counted)",
            family.COUNTER,
        )
        self._generated_tokens = metric(
            "tritonllm_engine_generated_tokens_total",
            "Tokens decoded (rate() of it is the engine's tokens/s)",
            family.COUNTER,
        )
        self._step_seconds = metric(
            "tritonllm_engine_step_seconds",
            "Mean duration of an engine step (prefills plus one batched decode) "
            "over the last flush interval",
            family.GAUGE,
        )
        self._prefix_queries = metric(
            "vllm:prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache",
            family.COUNTER,
        )
        self._prefix_hits = metric(
            "vllm:prefix_cache_hits_total",
            "Prompt tokens found in the prefix cache (not prefilled)",
            family.COUNTER,
        )
        self._guide_counters = [
            (metric(name, description, family.COUNTER), value)
            for name, description, value in _GUIDE_COUNTERS
        ]
        self._flush_interval_s = flush_interval_s
        self._last_flush = 0.0
        self._pending_steps: list[StepStats] = []

    def close(self) -> None:
        """Drop the metrics, then their families, while the stub still talks to the
        server (the model's ``finalize``). Left to the interpreter's exit, python_backend
        clears them after its shared memory is gone, and the stub dies with SIGSEGV on
        every unload (``MetricFamily::~MetricFamily`` -> ``Metric::Clear``)."""
        self._running = self._queued = self._step_seconds = None
        self._prompt_tokens = self._generated_tokens = None
        self._prefix_queries = self._prefix_hits = None
        self._guide_counters = []
        self._families.clear()

    def on_step(self, stats: StepStats) -> None:
        self._pending_steps.append(stats)
        now = time.monotonic()
        if now - self._last_flush >= self._flush_interval_s or not stats.running:
            self._flush(stats)
            self._last_flush = now

    def _flush(self, latest: StepStats) -> None:
        steps, self._pending_steps = self._pending_steps, []
        self._running.set(latest.running)
        self._queued.set(latest.queued)
        self._prompt_tokens.increment(sum(s.prefill_tokens for s in steps))
        self._generated_tokens.increment(sum(s.generated_tokens for s in steps))
        self._prefix_queries.increment(sum(s.prefix_queried_tokens for s in steps))
        self._prefix_hits.increment(sum(s.prefix_hit_tokens for s in steps))
        self._step_seconds.set(sum(s.seconds for s in steps) / len(steps))
        guides = [s.guides for s in steps if s.guides is not None]
        for counter, value in self._guide_counters if guides else ():
            counter.increment(sum(value(g) for g in guides))
