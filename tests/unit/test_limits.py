"""A tenant's requests per minute: the token bucket, OpenAI's and Anthropic's headers
on every answer, and the 429 whose ``retry-after``, honoured, gets the next request in."""

from __future__ import annotations

import asyncio
import textwrap
from datetime import UTC, datetime

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from serve.api.http import create_app
from serve.api.keyring import Keyring
from serve.api.limits import MemoryBuckets, duration
from tests.unit.test_http_api import FakeBackend, error_of


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


@pytest.fixture
def api(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(textwrap.dedent(TENANTS))
    keyring = Keyring(tenants_file=path, model_ids=["llm", "emb"])
    clock = Clock()
    app = create_app(FakeBackend(), keyring, buckets=MemoryBuckets(clock))
    return TestClient(app, raise_server_exceptions=False), clock


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
