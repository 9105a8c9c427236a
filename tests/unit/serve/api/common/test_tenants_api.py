"""Named tenants at the HTTP layer: a tenant sees and uses only its models (another is
the 404 of a model that does not exist, on every API), its keys share its stored
responses, and a key added to or removed from the file counts once it is re-read."""

from __future__ import annotations

import textwrap

import pytest
from fastapi.testclient import TestClient

from serve.api.common.fairness import FairQueue
from serve.api.common.keyring import RELOAD_S, Keyring
from serve.api.http import create_app
from serve.api.openai.responses.store import MemoryStore
from tests.support.fakes import FakeBackend, error_of

TENANTS = """
tenants:
  - name: chat
    keys: [chat-1, chat-2]
    models: [llm]
  - name: embed
    keys: [embed-1]
    models: [emb]
  - name: ops
    keys: [ops-1]
"""


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tenants(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(textwrap.dedent(TENANTS))
    return path


def api(tenants, clock=None) -> TestClient:
    backend = FakeBackend()
    backend.response_store = MemoryStore(max_bytes=1 << 20, ttl_s=60)
    keyring = Keyring(tenants_file=tenants, model_ids=["llm", "emb"], clock=clock or Clock())
    return TestClient(create_app(backend, keyring), raise_server_exceptions=False)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_a_tenant_sees_and_uses_only_its_models(tenants):
    client = api(tenants)
    listed = {
        key: [m["id"] for m in client.get("/v1/models", headers=bearer(key)).json()["data"]]
        for key in ("chat-1", "embed-1", "ops-1")
    }
    assert listed == {"chat-1": ["llm"], "embed-1": ["emb"], "ops-1": ["llm", "emb"]}
    assert client.get("/v1/models/llm", headers=bearer("chat-1")).status_code == 200
    assert error_of(client.get("/v1/models/emb", headers=bearer("chat-1")), 404)

    embed = {"model": "emb", "input": ["ab"]}
    refused = error_of(client.post("/v1/embeddings", json=embed, headers=bearer("chat-1")), 404)
    unknown = client.post("/v1/embeddings", json=embed | {"model": "nope"}, headers=bearer("ops-1"))
    # The same answer as for a model that does not exist: nothing says it is there.
    assert refused == error_of(unknown, 404) | {"message": "model 'emb' does not exist"}
    assert client.post("/v1/embeddings", json=embed, headers=bearer("embed-1")).status_code == 200

    completion = {"model": "llm", "prompt": "a b", "max_tokens": 2}
    for key, status in (("chat-1", 200), ("embed-1", 404), ("ops-1", 200)):
        answer = client.post("/v1/completions", json=completion, headers=bearer(key))
        assert answer.status_code == status, (key, answer.text)
    chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = client.post("/v1/chat/completions", json=chat, headers=bearer("embed-1"))
    assert error_of(answer, 404)["code"] == "model_not_found"
    messages = {"model": "llm", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    answer = client.post("/v1/messages", json=messages, headers={"x-api-key": "embed-1"})
    assert answer.status_code == 404, answer.text
    # /generate runs the first model: a tenant without it gets a 404 there too.
    assert client.get("/generate?query=a", headers=bearer("chat-1")).status_code == 200
    assert error_of(client.get("/generate?query=a", headers=bearer("embed-1")), 404)


def test_a_tenant_s_keys_share_its_stored_responses_and_no_one_else_s(tenants):
    client = api(tenants)
    body = {"model": "llm", "input": "a b", "max_output_tokens": 2}
    stored = client.post("/v1/responses", json=body, headers=bearer("chat-1")).json()
    url = f"/v1/responses/{stored['id']}"
    assert client.get(url, headers=bearer("chat-2")).json()["id"] == stored["id"]
    assert client.get(url, headers=bearer("ops-1")).status_code == 404
    assert client.delete(url, headers=bearer("ops-1")).status_code == 404
    assert client.delete(url, headers=bearer("chat-2")).status_code == 200


def test_a_key_added_or_removed_counts_once_the_file_is_read_again(tenants):
    clock = Clock()
    client = api(tenants, clock)
    assert client.get("/v1/models", headers=bearer("chat-3")).status_code == 401
    tenants.write_text(tenants.read_text().replace("[chat-1, chat-2]", "[chat-2, chat-3]"))
    clock.now += RELOAD_S
    assert client.get("/v1/models", headers=bearer("chat-3")).status_code == 200
    assert error_of(client.get("/v1/models", headers=bearer("chat-1")), 401)


def test_a_request_s_priority_is_its_own_never_more_urgent_than_its_tenant_s(tmp_path):
    """vLLM's order (lower first): a tenant's priority is its requests' default and the
    most urgent they may ask for; plain keys and an open API take what they ask."""
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: batch, keys: [batch-1], priority: 5}\n")
    backend = FakeBackend()
    client = TestClient(create_app(backend, Keyring(["plain"], tenants_file=path)))
    messages = [{"role": "user", "content": "hi"}]
    for key, asked, priority in [
        ("batch-1", None, 5),
        ("batch-1", -10, 5),
        ("batch-1", 9, 9),
        ("plain", None, 0),
        ("plain", -3, -3),
    ]:
        body = {"model": "llm", "messages": messages, "max_tokens": 2}
        body |= {} if asked is None else {"priority": asked}
        answer = client.post("/v1/chat/completions", json=body, headers=bearer(key))
        assert answer.status_code == 200, answer.text
        assert backend.params[-1].priority == priority, (key, asked)
    # The Messages API has no field for it: the tenant's.
    body = {"model": "llm", "max_tokens": 2, "messages": messages}
    assert client.post("/v1/messages", json=body, headers={"x-api-key": "batch-1"}).is_success
    assert backend.params[-1].priority == 5
    out_of_range = {"model": "llm", "messages": messages, "priority": 2**31}
    error_of(client.post("/v1/chat/completions", json=out_of_range, headers=bearer("plain")), 400)


def test_the_default_tenant_s_limits_hold_an_open_api_and_the_plain_keys(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: default, requests_per_minute: 2, priority: 3}\n")
    completion = {"model": "llm", "prompt": "a b", "max_tokens": 2}
    for plain in ([], ["plain-1", "plain-2"]):
        backend = FakeBackend()
        client = TestClient(create_app(backend, Keyring(plain, tenants_file=path)))
        keys = plain or [None, None]
        answers = [
            client.post("/v1/completions", json=completion, headers=bearer(k) if k else {})
            for k in (*keys, keys[0])
        ]
        # The plain keys share the tenant's minute, as a named tenant's keys do.
        assert [a.status_code for a in answers] == [200, 200, 429], plain
        assert answers[1].headers["x-ratelimit-remaining-requests"] == "0"
        assert error_of(answers[2], 429)["code"] == "rate_limit_exceeded"
        assert backend.params[-1].priority == 3


def test_fair_shares_seat_each_request_once_whatever_its_prompts_and_give_it_back(tenants):
    """A request holds one seat of its model's queue however many engine calls it makes
    (with a seat per call, one with more prompts than seats waited for itself), and
    gives it back when its answer has ended, streamed or whole, keyed or open."""
    waits = []
    queue = FairQueue(1, on_wait=lambda tenant, seconds: waits.append(tenant))
    for keyring, headers, tenant in (
        (Keyring(tenants_file=tenants, model_ids=["llm", "emb"]), bearer("chat-1"), "chat"),
        (Keyring(), {}, "default"),
    ):
        backend = FakeBackend()
        backend.fair_queues = {"llm": queue}
        client = TestClient(create_app(backend, keyring), raise_server_exceptions=False)
        waits.clear()
        many = {"model": "llm", "prompt": ["a b", "c d", "e f"], "n": 2, "max_tokens": 2}
        for stream in (False, True):
            answer = client.post("/v1/completions", json=many | {"stream": stream}, headers=headers)
            assert answer.status_code == 200, answer.text
            assert queue.taken == 0
        chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "n": 3}
        answer = client.post("/v1/chat/completions", json=chat, headers=headers)
        assert answer.status_code == 200 and len(answer.json()["choices"]) == 3
        assert queue.taken == 0 and waits == [tenant] * 3


def test_a_scrape_needs_a_key_but_takes_none_of_its_tenant_s_limits(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(
        "tenants:\n  - {name: ops, keys: [ops-1], requests_per_minute: 1, "
        "max_concurrent_requests: 1}\n"
    )
    client = TestClient(create_app(FakeBackend(), Keyring(tenants_file=path, clock=Clock())))
    assert error_of(client.get("/metrics"), 401)["code"] == "invalid_api_key"
    assert error_of(client.get("/metrics", headers=bearer("nobody")), 401)
    scrapes = [client.get("/metrics", headers=bearer("ops-1")) for _ in range(3)]
    assert [s.status_code for s in scrapes] == [200, 200, 200]
    assert "x-ratelimit-remaining-requests" not in scrapes[0].headers
    # The tenant's one request of the minute is still there, and then spent.
    assert client.get("/v1/models", headers=bearer("ops-1")).status_code == 200
    assert client.get("/v1/models", headers=bearer("ops-1")).status_code == 429
