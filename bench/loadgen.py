"""An async closed-loop load generator for streamed generation, over HTTP or Triton's gRPC.

At a concurrency level ``c`` there are ``c`` clients; each sends its next request as
soon as its last one has ended, until the level's prompts are used up. Every request
streams, and the client stamps the arrival of each chunk that carries text, so:

- time to first token (TTFT): sent -> first text chunk;
- inter-token latency (ITL): the gaps between text chunks of one request (one token
  per chunk while no hop is behind; a hop that is behind sends several at once);
- time per output token (TPOT): first to last text chunk over the tokens after the
  first, per request (vLLM's definition): per token whatever a chunk carries;
- end to end (e2e): sent -> the stream's end.

Two kinds of target speak the same protocol to the loop: an OpenAI-compatible
``/v1/completions`` endpoint (aiohttp, server-sent events; a subclass may post to
``/v1/chat/completions``) and Triton's ensemble (the asyncio tritonclient, one gRPC
stream per request, as the Serve replica does). Both clients parse their protocol in
native code, so the load generator takes as little as it can of the CPU it shares with
the system it measures. At 256 streams aiohttp (as vLLM's serving benchmark uses) took
0.019-0.024 CPU ms per streamed token, httpx (whose HTTP parser, h11, is pure Python)
0.041-0.061 with larger chunks (``make bench-capacity``, 2026-12-05).

A 503 is a *rejection* (backpressure past the configured queue bound), counted apart
from errors, and only when it carries ``Retry-After``; any other failure, a stream
that ends in an error event, or an answer shorter than asked is an error.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from bench.common import percentile


@dataclass
class RequestRecord:
    sent: float
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each text chunk
    end: float = 0.0
    tokens: int = 0
    rejected: bool = False  # a 503 with Retry-After
    error: str | None = None
    text: str = ""  # the answer (choice 0's text or chat content)
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.rejected and bool(self.arrivals)


class Target(Protocol):
    name: str

    async def request(self, prompt: str, output_len: int) -> RequestRecord: ...

    async def aclose(self) -> None: ...


class OpenAITarget:
    """``POST {base_url}/v1/completions`` with ``stream: true``: exactly ``output_len``
    greedy tokens (``min_tokens`` = ``max_tokens``), usage in the last chunk.

    A subclass may post another ``path`` (``/v1/chat/completions``: the events' chat
    deltas are read alike), build another :meth:`body` and :meth:`check` its records
    otherwise."""

    path = "/v1/completions"

    def __init__(
        self,
        name: str,
        base_url: str,
        model: str,
        max_connections: int = 256,
        headers: dict[str, str] | None = None,
    ):
        """``headers``: sent with every request (an API key's ``Authorization``)."""
        self.name = name
        self.model = model
        self._base_url = base_url.rstrip("/")
        self._max_connections = max_connections
        self._headers = headers
        self._session = None  # made in the loop that runs the requests (aiohttp's rule)

    def _http(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=900.0),
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                headers=self._headers,
            )
        return self._session

    def body(self, prompt: str, output_len: int) -> dict:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": output_len,
            "min_tokens": output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def check(self, record: RequestRecord, output_len: int) -> None:
        _check_length(record, output_len)

    async def request(self, prompt: str, output_len: int) -> RequestRecord:
        body = self.body(prompt, output_len)
        record = RequestRecord(sent=time.perf_counter())
        try:
            url = self._base_url + self.path
            async with self._http().post(url, json=body) as response:
                if response.status != 200:
                    text = await response.text()
                    _refused(record, response.status, response.headers, text)
                else:
                    await _read_events(response, record)
        except Exception as error:  # a broken connection, a timeout: counted, never raised
            record.error = f"{type(error).__name__}: {error}"
        record.end = time.perf_counter()
        self.check(record, output_len)
        return record

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _refused(record: RequestRecord, status: int, headers, text: str) -> None:
    if status == 503 and "retry-after" in headers:
        record.rejected = True
    else:
        missing = " without Retry-After" if status == 503 else ""
        record.error = f"HTTP {status}{missing}: {text[:200]}"


async def _sse_lines(response) -> AsyncIterator[str]:
    """The stream's lines as SSE ends them (at \n, \r\n), split as bytes: a \n byte
    is never part of another UTF-8 character. Not ``str.splitlines``, which also ends a
    line at U+0085, U+2028 and U+2029, which a model's text may hold raw inside an
    event's JSON (Ray Serve LLM's does): the event's half would then fail to parse."""
    pending = b""
    async for data in response.content.iter_any():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode()
    if pending:
        yield pending.decode()


async def _read_events(response, record: RequestRecord) -> None:
    async for line in _sse_lines(response):
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if "error" in event:
            record.error = f"error event: {event['error'].get('message')}"
            continue
        texts = [_text(choice) for choice in event.get("choices", ())]
        if any(texts):
            record.arrivals.append(time.perf_counter())
        for choice, text in zip(event.get("choices", ()), texts, strict=True):
            if choice.get("index", 0) == 0:
                record.text += text
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
        if event.get("usage"):
            record.tokens = event["usage"]["completion_tokens"]
    record.error = record.error or "the stream ended without [DONE]"


def _text(choice: dict) -> str:
    """A choice's new text: a completion's ``text`` or a chat chunk's ``delta.content``."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _check_length(record: RequestRecord, output_len: int) -> None:
    if record.error is None and not record.rejected and record.tokens != output_len:
        record.error = f"{record.tokens} tokens instead of {output_len}"


class TritonTarget:
    """Triton's ensemble over gRPC streaming, with the tensors the Serve replica sends."""

    def __init__(self, name: str, grpc_url: str):
        self.name = name
        self._url = grpc_url
        self._client = None  # made in the loop that runs the requests (a gRPC aio rule)

    def _channel(self):
        import tritonclient.grpc.aio as grpc_aio

        if self._client is None:
            self._client = grpc_aio.InferenceServerClient(self._url)
        return self._client

    async def request(self, prompt: str, output_len: int) -> RequestRecord:
        from serve.engines.triton.client import infer_inputs
        from serve.engines.triton.requests import ensemble_inputs
        from serve.generation import GenerateParams
        from tritonllm import contract

        params = GenerateParams(prompt, max_tokens=output_len, min_tokens=output_len)

        async def requests():
            inputs = infer_inputs(ensemble_inputs(params))
            request_id = uuid.uuid4().hex
            yield {"model_name": contract.ENSEMBLE, "inputs": inputs, "request_id": request_id}

        record = RequestRecord(sent=time.perf_counter())
        try:
            async for result, error in self._channel().stream_infer(requests()):
                if error is not None:
                    record.error = str(error)
                    break
                if not result.get_response().outputs:
                    continue
                if result.as_numpy(contract.TEXT_OUTPUT.name).reshape(-1)[0]:
                    record.arrivals.append(time.perf_counter())
                record.tokens = int(result.as_numpy(contract.NUM_OUTPUT_TOKENS.name).reshape(-1)[0])
        except Exception as error:
            record.error = f"{type(error).__name__}: {error}"
        record.end = time.perf_counter()
        _check_length(record, output_len)
        return record

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()


async def run_level(
    target: Target, prompts: list[str], concurrency: int, output_len: int
) -> tuple[list[RequestRecord], float]:
    """Every prompt once, ``concurrency`` at a time (closed loop); records and wall time."""
    todo = list(reversed(prompts))
    records: list[RequestRecord] = []

    async def client() -> None:
        while todo:
            records.append(await target.request(todo.pop(), output_len))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records, time.perf_counter() - start


def summarize(records: list[RequestRecord], seconds: float) -> dict:
    """The standard serving figures of one level (times in ms)."""
    ok = [r for r in records if r.ok]
    ttft = [1000 * (r.arrivals[0] - r.sent) for r in ok]
    itl = [1000 * (b - a) for r in ok for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    e2e = [1000 * (r.end - r.sent) for r in ok]
    tpot = [1000 * (r.arrivals[-1] - r.arrivals[0]) / (r.tokens - 1) for r in ok if r.tokens > 1]
    chunks = sum(len(r.arrivals) for r in ok)
    errors = [r.error for r in records if r.error is not None]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(errors),
        "rejected_503": sum(r.rejected for r in records),
        "seconds": seconds,
        "requests_per_s": len(ok) / seconds,
        "output_tokens_per_s": sum(r.tokens for r in ok) / seconds,
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p90_ms": percentile(ttft, 0.9),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "itl_p50_ms": percentile(itl, 0.5),
        "itl_p99_ms": percentile(itl, 0.99),
        "e2e_p50_ms": percentile(e2e, 0.5),
        "e2e_p99_ms": percentile(e2e, 0.99),
        "tpot_p50_ms": percentile(tpot, 0.5),
        "tpot_p99_ms": percentile(tpot, 0.99),
        "tokens_per_chunk": sum(r.tokens for r in ok) / chunks if chunks else float("nan"),
        "first_errors": sorted(set(errors))[:3],
    }
