"""The soak's traffic (``python -m tests.soak``): one client thread per request class,
each sending its class back to back until stopped, every outcome kept.

A class is a function of an ``httpx.Client`` returning the outcome's status: the HTTP
status, or what went wrong instead (``ReadTimeout``, ``stream-error``, ``bad-body``).
Every request has a timeout, so a request that hangs ends as ``ReadTimeout`` (a failed
soak) instead of holding its thread.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx

from tests.integration.test_production import MODEL

EMBEDDING_MODEL = "all-MiniLM-L6-v2"
# No byte for this long is a hang (the slowest whole answer here takes a few seconds).
REQUEST_TIMEOUT = httpx.Timeout(60, connect=10)
# Each class's expected status; a 503 with Retry-After (queue full) is allowed for
# every class: it is the documented answer of a full deployment.
EXPECTED = {"bad-model": 404, "bad-max-tokens": 400, "bad-json": 400}
RETRYABLE = "503"
MESSAGES = [{"role": "user", "content": "Tell me about cats."}]


@dataclass
class Outcome:
    kind: str
    status: str
    latency_s: float
    detail: str = ""
    sent_at: float = 0.0  # time.monotonic() when it was sent


def status_of(response: httpx.Response) -> str:
    """The status, with a 503 lacking ``Retry-After`` set apart (never documented)."""
    if response.status_code == 503 and "retry-after" not in response.headers:
        return "503-without-retry-after"
    return str(response.status_code)


def whole(client: httpx.Client, path: str, body: dict, answered: Callable[[dict], bool]):
    response = client.post(path, json=body)
    if response.status_code == 200 and not answered(response.json()):
        return "bad-body", response.text[:300]
    return status_of(response), "" if response.status_code == 200 else response.text[:300]


def streamed(client: httpx.Client, path: str, body: dict, leave_after: int = 0):
    """A streamed answer read to its ``[DONE]``, or left after ``leave_after`` events
    (closing the connection: the client disconnects mid-stream)."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            return status_of(response), response.read().decode()[:300]
        events = 0
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "200", ""
            if "error" in json.loads(line[6:]):
                return "stream-error", line[:300]
            events += 1
            if events == leave_after:
                return "200", ""
    return "stream-cut", "the stream ended without [DONE]"


def has_text(answer: dict) -> bool:
    return isinstance(answer["choices"][0]["text"], str)


def has_message(answer: dict) -> bool:
    return isinstance(answer["choices"][0]["message"]["content"], str)


def chat(max_tokens: int) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens}


def completion(max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "prompt": "The cat", "max_tokens": max_tokens, **extra}


def bad_request(kind: str) -> Callable[[httpx.Client], tuple[str, str]]:
    def send(client: httpx.Client):
        if kind == "bad-json":
            response = client.post(
                "/v1/completions",
                content=b'{"model": "tritonllm-default", "prompt": ',
                headers={"content-type": "application/json"},
            )
        elif kind == "bad-model":
            response = client.post("/v1/completions", json={**completion(8), "model": "nope"})
        else:
            response = client.post("/v1/completions", json=completion(100_000))
        error = response.status_code != 200 and "error" in response.json()
        return status_of(response), "" if error else response.text[:300]

    return send


CLASSES: dict[str, Callable[[httpx.Client], tuple[str, str]]] = {
    "chat-stream": lambda c: streamed(c, "/v1/chat/completions", chat(48)),
    "chat": lambda c: whole(c, "/v1/chat/completions", chat(32), has_message),
    "completion-stream": lambda c: streamed(c, "/v1/completions", completion(48)),
    "completion": lambda c: whole(c, "/v1/completions", completion(32), has_text),
    "embeddings": lambda c: whole(
        c,
        "/v1/embeddings",
        {"model": EMBEDDING_MODEL, "input": ["a cat", "a dog on a mat"]},
        lambda answer: len(answer["data"]) == 2,
    ),
    # Leaves a long answer after 3 events: its engine slot must be freed.
    "disconnect": lambda c: streamed(
        c, "/v1/completions", completion(300, min_tokens=300), leave_after=3
    ),
    **{kind: bad_request(kind) for kind in EXPECTED},
}


def attempt(kind: str, client: httpx.Client) -> Outcome:
    start = time.monotonic()
    try:
        status, detail = CLASSES[kind](client)
    except (httpx.HTTPError, ValueError, KeyError) as error:  # a timeout: a hang
        status, detail = type(error).__name__, str(error)[:300]
    return Outcome(kind, status, time.monotonic() - start, detail, sent_at=start)


def expected(outcome: Outcome) -> bool:
    kind = "completion" if outcome.kind == "burst" else outcome.kind
    return outcome.status in (str(EXPECTED.get(kind, 200)), RETRYABLE)


class Traffic:
    """Every class at once from its own thread (the bad requests from one thread in
    turn), plus a burst of ``burst_size`` whole completions every ``burst_period_s``;
    or, given ``clients``, one thread for each class named there (no bursts)."""

    def __init__(
        self,
        url: str,
        burst_size: int = 24,
        burst_period_s: float = 10,
        clients: list[str] | None = None,
    ):
        self.url, self.burst_size, self.burst_period_s = url, burst_size, burst_period_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        steady = [[kind] for kind in CLASSES if kind not in EXPECTED] + [list(EXPECTED)]
        # Daemons: a client stuck past its timeouts is counted (stop) and never keeps
        # the soak from exiting.
        self._threads = [
            threading.Thread(target=self._send, args=(k,), daemon=True)
            for k in (steady if clients is None else [[kind] for kind in clients])
        ]
        if clients is None:
            self._threads.append(threading.Thread(target=self._bursts, daemon=True))

    def _client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT)

    def _send(self, kinds: list[str]) -> None:
        with self._client() as client:
            for kind in itertools.cycle(kinds):
                if self._stop.is_set():
                    return
                outcome = attempt(kind, client)
                self.outcomes.append(outcome)
                # Retry-After honoured; bad requests kept to a small share.
                if outcome.status == RETRYABLE or outcome.kind in EXPECTED:
                    time.sleep(1)

    def _bursts(self) -> None:
        with self._client() as client, ThreadPoolExecutor(self.burst_size) as pool:
            while not self._stop.wait(self.burst_period_s):
                burst = pool.map(lambda _: attempt("completion", client), range(self.burst_size))
                self.outcomes.extend(replace(outcome, kind="burst") for outcome in burst)

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = 90) -> int:
        """Stops the clients; returns how many are still in a request after
        ``timeout_s`` (each request's own timeout is shorter: any is a hang)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(thread.is_alive() for thread in self._threads)

    def __exit__(self, *exc) -> None:
        self.stop()

    def counts(self, since: float = 0.0, until: float = float("inf")) -> dict[str, Counter]:
        """Statuses by class of the requests sent in [since, until) (monotonic times)."""
        counts: dict[str, Counter] = {}
        for outcome in self.outcomes:
            if since <= outcome.sent_at < until:
                counts.setdefault(outcome.kind, Counter())[outcome.status] += 1
        return counts
