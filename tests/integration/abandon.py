"""Clients that give up on non-streamed generations, and how soon the engine is free after.

The engine's load is read from the metrics port of each Triton serving the test's
repository (found by its command line), live: the app's ``GET /metrics`` is up to
one push period (5 s) old.
"""

from __future__ import annotations

import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tritonllm-default"
LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Where is the cat?"}],
    "max_tokens": 400,
    "min_tokens": 400,
    "ignore_eos": True,
}


# The engine is idle this soon after the clients left. A leak shows as tens of seconds
# (30 x 400 tokens on one slot ran for 51-68 s); on a loaded 2-core CI machine a healthy
# stack has taken up to 1.7 s (0.03-0.3 s on a quiet one).
IDLE_WITHIN_S = 3.0
SHORT_WITHIN_S = 2.0


def triton_metrics_urls(repository: Path) -> list[str]:
    """The metrics endpoints of the Triton servers that serve ``repository``."""
    mark = f"--model-repository={repository}".encode()
    urls = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:  # gone meanwhile
            continue
        if mark in args:
            (port,) = [a for a in args if a.startswith(b"--metrics-port=")]
            urls.append(f"http://127.0.0.1:{int(port.split(b'=')[1])}/metrics")
    return urls


def engine_figures(urls: list[str]) -> dict[str, float]:
    """The engines' ``tritonllm_engine_*`` samples, summed over the servers."""
    figures: dict[str, float] = {}
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
            for sample in family.samples:
                if sample.name.startswith("tritonllm_engine_"):
                    figures[sample.name] = figures.get(sample.name, 0.0) + sample.value
    return figures


def engine_load(urls: list[str]) -> float:
    """Sequences the engines run or hold in their queues."""
    figures = engine_figures(urls)
    return (
        figures["tritonllm_engine_running_sequences"] + figures["tritonllm_engine_queued_requests"]
    )


def give_up(url: str, clients: int, after_s: float) -> None:
    """``clients`` concurrent non-streamed 400-token chat completions, each abandoned
    by its client after ``after_s`` without an answer (its read timeout closes the
    connection)."""
    context = ssl.create_default_context()  # one for all: each costs ~20 ms of CPU

    def abandoned(_) -> httpx.Response | None:
        with httpx.Client(timeout=after_s, verify=context) as client:
            try:
                return client.post(f"{url}/v1/chat/completions", json=LONG)
            except httpx.TimeoutException:
                return None

    with ThreadPoolExecutor(clients) as pool:
        answered = [r for r in pool.map(abandoned, range(clients)) if r is not None]
    assert not answered, [(r.status_code, r.text[:200]) for r in answered]


def abandon_then_serve(url: str, repository: Path, clients: int = 30) -> tuple[float, float]:
    """``clients`` requests given up after 0.5 s, then: seconds until the engine holds
    no sequence (from the moment the last client left), and seconds a 10-token
    request takes after that."""
    metrics = triton_metrics_urls(repository)
    assert metrics, f"no Triton serves {repository}"
    # One answer first: what a fresh stack does once (channels, model configs, imports
    # on the cancel path) is not what the figures are about.
    warm_up = {**LONG, "max_tokens": 2, "min_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=warm_up, timeout=120).status_code == 200
    prefilled = engine_figures(metrics)["tritonllm_engine_prompt_tokens_total"]
    give_up(url, clients, after_s=0.5)
    left = time.monotonic()
    while engine_load(metrics) and time.monotonic() - left < 60:
        time.sleep(0.05)
    idle_s = time.monotonic() - left
    # The engine did start on them: a test that never reached it would pass as well.
    assert engine_figures(metrics)["tritonllm_engine_prompt_tokens_total"] > prefilled
    start = time.monotonic()
    short = {**LONG, "max_tokens": 10, "min_tokens": 10}
    response = httpx.post(f"{url}/v1/chat/completions", json=short, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 10
    short_s = time.monotonic() - start
    print(f"engine idle {idle_s:.2f} s after the clients left, then 10 tokens in {short_s:.2f} s")
    return idle_s, short_s
