"""A tenant's requests per minute: the token bucket, OpenAI's and Anthropic's headers
on every answer, and the 429 whose ``retry-after``, honoured, gets the next request in."""

from __future__ import annotations

import asyncio
import json
import textwrap
from datetime import UTC, datetime

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from serve.api.common.keyring import Keyring
from serve.api.common.limits import MemoryBuckets, RedisBuckets, duration
from serve.api.http import create_app
from serve.engines.triton.launcher import free_port
from tests.support.fakes import EndlessBackend, FakeBackend, error_of


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_holds_a_minute_of_requests_and_refills_at_the_limit_per_minute():
    clock = Clock()
    buckets = MemoryBuckets(clock)
    taken = [asyncio.run(buckets.take("a", 60)) for _ in range(61)]
    assert all(q.allowed for q in taken[:60]) and not taken[60].allowed
    assert [q.remaining for q in taken[:3]] == [59, 58, 57] and taken[59].remaining == 0
    assert taken[60].retry_after_s == pytest.approx(1.0) and taken[59].reset_s == 60.0
    assert asyncio.run(buckets.take("b", 60)).allowed  # each bucket its own
    clock.now += 0.5
    assert not asyncio.run(buckets.take("a", 60)).allowed
    clock.now += 0.5  # one request refilled: one in, the next not
    assert asyncio.run(buckets.take("a", 60)).allowed
    assert not asyncio.run(buckets.take("a", 60)).allowed
    clock.now += 3600  # a long idle refills to the limit, no more
    assert asyncio.run(buckets.take("a", 60)).remaining == 59


@pytest.mark.parametrize(
    "seconds, text", [(0.02, "20ms"), (1, "1s"), (1.5, "1.5s"), (360, "6m0s"), (61.25, "1m1.25s")]
)
def test_reset_times_read_as_openai_writes_them(seconds, text):
    assert duration(seconds) == text


TENANTS = """
tenants:
  - name: slow
    keys: [slow-1, slow-2]
    requests_per_minute: 2
  - name: free
    keys: [free-1]
"""


def tenants_api(tmp_path, tenants: str) -> tuple[TestClient, Clock]:
    """The API over the fake engine with ``tenants``, its buckets on a clock of the test's."""
    path = tmp_path / "tenants.yaml"
    path.write_text(textwrap.dedent(tenants))
    keyring = Keyring(tenants_file=path, model_ids=["llm", "emb"])
    clock = Clock()
    app = create_app(FakeBackend(), keyring, buckets=MemoryBuckets(clock))
    return TestClient(app, raise_server_exceptions=False), clock


@pytest.fixture
def api(tmp_path):
    return tenants_api(tmp_path, TENANTS)


def test_a_tenant_past_its_limit_gets_openai_s_429_and_its_keys_share_the_limit(api):
    client, clock = api
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="slow-1", http_client=client)
    first = sdk.models.with_raw_response.list()
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"] == "30s"
    body = {"model": "llm", "prompt": "a b", "max_tokens": 2, "stream": True}
    streamed = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer slow-2"})
    assert streamed.status_code == 200 and streamed.headers["x-ratelimit-remaining-requests"] == "0"
    refused = client.get("/v1/models", headers={"Authorization": "Bearer slow-1"})
    error = error_of(refused, 429)
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert refused.headers["retry-after"] == "30"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError):
        sdk.with_options(max_retries=0).models.list()
    # Another tenant is not held to it, and a tenant with no limit gets no headers.
    free = client.get("/v1/models", headers={"Authorization": "Bearer free-1"})
    assert free.status_code == 200 and "x-ratelimit-limit-requests" not in free.headers
    clock.now += int(refused.headers["retry-after"])  # honoured: the next request is in
    assert client.get("/v1/models", headers={"Authorization": "Bearer slow-1"}).status_code == 200


def test_the_messages_api_answers_with_anthropic_s_headers_and_error(api):
    client, clock = api
    sdk = anthropic.Anthropic(
        base_url="http://testserver", api_key="slow-1", http_client=client, max_retries=0
    )
    body = {"model": "llm", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    answer = sdk.messages.with_raw_response.create(**body)
    assert answer.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert answer.headers["anthropic-ratelimit-requests-remaining"] == "1"
    reset = datetime.strptime(
        answer.headers["anthropic-ratelimit-requests-reset"], "%Y-%m-%dT%H:%M:%SZ"
    )
    assert 0 < (reset.replace(tzinfo=UTC) - datetime.now(UTC)).total_seconds() <= 31
    assert "x-ratelimit-limit-requests" not in answer.headers
    sdk.messages.create(**body)
    with pytest.raises(anthropic.RateLimitError) as refused:
        sdk.messages.create(**body)
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert refused.value.response.headers["retry-after"] == "30"


TOKEN_TENANTS = """
tenants:
  - name: tok
    keys: [tok-1]
    tokens_per_minute: 30
"""


@pytest.fixture
def token_api(tmp_path):
    return tenants_api(tmp_path, TOKEN_TENANTS)


def test_a_request_reserves_prompt_and_max_tokens_and_settles_with_the_engine_s_counts(token_api):
    client, clock = token_api
    auth = {"Authorization": "Bearer tok-1"}
    # "a b c d": 7 characters, 2 tokens at 4 a token, + max_tokens 10 reserved; the
    # fake engine counts 4 prompt tokens and answers 4: 8 used, 4 given back.
    body = {"model": "llm", "prompt": "a b c d", "max_tokens": 10}
    first = client.post("/v1/completions", json=body, headers=auth)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] == 8
    assert first.headers["x-ratelimit-limit-tokens"] == "30"
    assert first.headers["x-ratelimit-remaining-tokens"] == "18"
    streamed = client.post("/v1/completions", json=body | {"stream": True}, headers=auth)
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    assert streamed.headers["x-ratelimit-remaining-tokens"] == "10"  # 30 - 8 - 12
    # 16 used so far: 2 + 16 do not fit in 14. OpenAI's 429 of type tokens, whose
    # retry-after, honoured, gets the request in.
    refused = client.post("/v1/completions", json=body | {"max_tokens": 16}, headers=auth)
    error = error_of(refused, 429)
    assert error["type"] == "tokens" and error["code"] == "rate_limit_exceeded"
    assert "30 tokens per minute" in error["message"] and "asks 18" in error["message"]
    assert refused.headers["retry-after"] == "8"  # 4 tokens refill in 8 s at 30 a minute
    clock.now += 8
    again = client.post("/v1/completions", json=body | {"max_tokens": 16}, headers=auth)
    assert again.status_code == 200


def test_a_request_larger_than_the_minute_is_refused_without_a_retry_after(token_api):
    client, _ = token_api
    body = {"model": "llm", "prompt": "a " * 40, "max_tokens": 16}  # 20 + 16 tokens
    refused = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer tok-1"})
    error = error_of(refused, 429)
    assert error["message"].startswith("request too large for tenant 'tok'")
    assert "retry-after" not in refused.headers


def test_chat_choices_embeddings_and_messages_count_against_the_tokens(token_api):
    client, _ = token_api
    sdk = openai.OpenAI(
        base_url="http://testserver/v1", api_key="tok-1", http_client=client, max_retries=0
    )
    messages = [{"role": "user", "content": "a b"}]
    # n=2: two engine requests, each reserving 1 + 10 and using 2 + 2.
    chat = sdk.chat.completions.with_raw_response.create(
        model="llm", messages=messages, n=2, max_tokens=10
    )
    assert len(chat.parse().choices) == 2 and chat.headers["x-ratelimit-limit-tokens"] == "30"
    # 15 characters: 4 tokens reserved (30 - 8 - 4), then the 8 the fake engine counts.
    embedded = sdk.embeddings.with_raw_response.create(model="emb", input=["a b c d e f g h"])
    assert embedded.headers["x-ratelimit-remaining-tokens"] == "18"
    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="tok-1", http_client=client, max_retries=0
    )
    body = {"model": "llm", "max_tokens": 16, "messages": messages}  # 17 > 30 - 16
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(**body)
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    headers = refused.value.response.headers
    assert headers["anthropic-ratelimit-tokens-limit"] == "30"
    assert headers["anthropic-ratelimit-tokens-remaining"] == "14"
    assert "x-ratelimit-limit-tokens" not in headers


@pytest.mark.parametrize("fail_open", [True, False])
def test_health_says_when_the_limits_store_cannot_be_reached(fail_open):
    """Open: ready, saying requests are not limited; closed: a 503, since every request
    under a limit is refused meanwhile."""
    buckets = RedisBuckets(f"redis://127.0.0.1:{free_port()}/0", "x:", fail_open)
    api = TestClient(create_app(FakeBackend(), Keyring(()), buckets=buckets))
    answer = api.get("/health")
    if fail_open:
        assert answer.status_code == 200
        assert "requests are not limited" in answer.json()["rate_limits"]
    else:
        error = error_of(answer, 503)
        assert error["code"] == "rate_limits_unavailable" and "closed" in error["message"]
    # A store that answers says nothing.
    assert (
        "rate_limits"
        not in TestClient(create_app(FakeBackend(), Keyring(()))).get("/health").json()
    )


def test_each_keyed_request_s_tokens_count_for_its_tenant_streamed_or_not():
    backend = FakeBackend()
    api = TestClient(create_app(backend, Keyring(["k1"])))
    auth = {"Authorization": "Bearer k1"}
    body = {"model": "llm", "prompt": "a b c", "max_tokens": 2, "n": 2}
    assert api.post("/v1/completions", json=body, headers=auth).status_code == 200
    streamed = api.post("/v1/completions", json=body | {"stream": True}, headers=auth)
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    embedded = {"model": "emb", "input": ["x y"]}
    assert api.post("/v1/embeddings", json=embedded, headers=auth).status_code == 200
    # 4 generations of 3 prompt and 2 answer tokens; 2 embedded tokens.
    assert backend.tenant_tokens == {"default": [4 * 3 + 2, 4 * 2]}


AT_ONCE = """
tenants:
  - name: one
    keys: [one-1]
    max_concurrent_requests: 1
"""


async def _call(
    app,
    method: str,
    path: str,
    key: str,
    body: dict | None = None,
    leave: asyncio.Event | None = None,
) -> list:
    """One request through the ASGI app, message by message; with ``leave`` the client
    goes away once that event is set (an endless stream held open until then)."""
    payload = json.dumps(body).encode() if body is not None else b""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "headers": [
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {key}".encode()),
        ],
    }
    received = [{"type": "http.request", "body": payload, "more_body": False}]
    done, sent = asyncio.Event(), []

    async def receive():
        if received:
            return received.pop()
        await (leave or done).wait()  # the client goes away, or its answer has ended
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    await app(scope, receive, send)
    return sent


class CountingEndlessBackend(EndlessBackend):
    async def _chunks(self, params):
        self.params.append(params)  # the stream is under way
        async for chunk in super()._chunks(params):
            yield chunk


def test_a_tenant_s_requests_at_once_hold_a_seat_each_until_their_answer_ends(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(textwrap.dedent(AT_ONCE))
    backend = CountingEndlessBackend()
    app = create_app(backend, Keyring(tenants_file=path, model_ids=["llm", "emb"]))
    stream = {"model": "llm", "prompt": "a b", "stream": True}

    async def scenario():
        leave = asyncio.Event()
        held = asyncio.create_task(_call(app, "POST", "/v1/completions", "one-1", stream, leave))
        while not backend.params:  # the stream has its seat and is generating
            await asyncio.sleep(0.01)
        refused = await _call(app, "GET", "/v1/models", "one-1")
        leave.set()  # the client goes away: its seat is given back
        await asyncio.wait_for(held, 10)
        await asyncio.sleep(0.05)  # the seat is given back off the answer's path
        again = await _call(app, "GET", "/v1/models", "one-1")
        return refused, again

    refused, again = asyncio.run(scenario())
    start = refused[0]
    assert start["status"] == 429 and (b"retry-after", b"1") in start["headers"]
    error = json.loads(refused[1]["body"])["error"]
    assert error["code"] == "rate_limit_exceeded" and "1 at most" in error["message"]
    assert again[0]["status"] == 200
