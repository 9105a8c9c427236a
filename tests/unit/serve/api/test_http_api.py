"""The HTTP layer over a fake backend: auth, limits, error objects, OpenAI shapes.

The fake stands in for the replicas (what is under test here is the front door:
routing, validation, status codes, response shapes); the real stack is tested in
tests/integration/test_serve_app.py and test_production.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging

import numpy as np
import pytest
import schemathesis
from fastapi.testclient import TestClient

from serve.api.common.auth import app_keyring
from serve.api.common.errors import APIError, Overloaded
from serve.api.http import create_app
from serve.config import APIKeys
from tests.fuzzing import server_errors
from tests.support.fakes import EndlessBackend, FakeBackend, client, error_of


def test_completions_and_generate_answer_from_the_backend():
    api = client()
    body = api.post("/v1/completions", json={"model": "llm", "prompt": "a b c", "max_tokens": 2})
    assert body.json()["choices"][0]["text"] == " a b"
    assert body.json()["choices"][0]["finish_reason"] == "length"
    assert body.json()["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert api.get("/generate", params={"query": "x y"}).json() == {"text": " x y"}
    assert api.post("/generate", json={"prompt": "x y", "max_new_tokens": 1}).json() == {
        "text": " x"
    }


def test_health_is_ready_only_when_every_model_is_and_needs_no_api_key():
    backend = FakeBackend()
    api = client(backend, keys=frozenset({"k"}))
    assert api.get("/health").json() == {"status": "ready", "models": ["llm", "emb"]}
    backend.waiting = {"emb": "no running replica"}
    error = error_of(api.get("/health"), 503)
    assert error["code"] == "model_not_ready" and "emb: no running replica" in error["message"]
    assert "llm" not in error["message"]
    assert api.get("/health").headers["retry-after"] == "5"
    backend.waiting = {}
    assert api.get("/health").status_code == 200
    assert api.get("/v1/models").status_code == 401  # the API itself still wants the key


def test_metrics_are_prometheus_text_and_want_the_api_key_when_keys_are_set():
    api = client(FakeBackend(), keys=frozenset({"k"}))
    assert error_of(api.get("/metrics"), 401)["code"] == "invalid_api_key"
    response = api.get("/metrics", headers={"Authorization": "Bearer k"})
    assert response.status_code == 200 and response.text == "# TYPE up gauge\nup 1\n"
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert client().get("/metrics").status_code == 200  # no keys configured: open
    down = client(FakeBackend(error=Overloaded("the metrics collector is not available")))
    assert error_of(down.get("/metrics"), 503)["type"] == "server_error"


def test_streamed_chat_has_role_first_deltas_reason_usage_and_done():
    api = client()
    body = {
        "model": "llm",
        "messages": [{"role": "user", "content": "one two"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with api.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == " one two"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
    assert {e["object"] for e in events} == {"chat.completion.chunk"}


def test_an_error_mid_stream_ends_with_an_error_event_and_done():
    api = client(FakeBackend(fail_after=1, error=Overloaded("replica lost")))
    body = {"model": "llm", "prompt": "a b c", "stream": True}
    with api.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == " a"
    assert json.loads(lines[-2][6:])["error"]["message"] == "replica lost"
    assert lines[-1] == "data: [DONE]"


async def _asgi_messages(app, path: str, body: dict, leave_after: int | None = None) -> list:
    """What the app sends for one request, ASGI message by message: each body message
    is one write to the socket. With ``leave_after``, the client disconnects once that
    many messages came."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    received = [{"type": "http.request", "body": payload, "more_body": False}]
    done = asyncio.Event()
    sent = []

    async def receive():
        if received:
            return received.pop()
        await done.wait()  # the disconnect listener waits here until the answer ended
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()
        if leave_after is not None and len(sent) >= leave_after:
            done.set()  # the client goes away

    await app(scope, receive, send)
    return sent


def test_a_stream_sends_its_openings_with_the_first_chunk_and_its_end_in_one_write():
    body = {
        "model": "llm",
        "messages": [{"role": "user", "content": "one two three"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    messages = asyncio.run(_asgi_messages(create_app(FakeBackend()), "/v1/chat/completions", body))
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    writes = [m["body"].decode() for m in messages[1:]]
    assert [m["more_body"] for m in messages[1:]] == [True, True, True, False]
    first = [json.loads(e[6:]) for e in writes[0].removesuffix("\n\n").split("\n\n")]
    assert [e["choices"][0]["delta"] for e in first] == [
        {"role": "assistant", "content": ""},
        {"content": " one"},
    ]
    *events, done = writes[-1].removesuffix("\n\n").split("\n\n")
    last, usage = (json.loads(e[6:]) for e in events)
    assert last["choices"][0]["finish_reason"] == "stop"
    assert usage["usage"]["completion_tokens"] == 3
    assert done == "data: [DONE]"


def test_a_client_that_leaves_mid_stream_closes_the_answer_and_the_app_returns():
    backend = EndlessBackend()
    body = {"model": "llm", "prompt": "a b c", "stream": True}

    async def scenario():
        app = create_app(backend)
        messages = await asyncio.wait_for(
            _asgi_messages(app, "/v1/completions", body, leave_after=2), 10
        )
        return messages, backend.closed.is_set()

    messages, closed = asyncio.run(scenario())
    assert closed  # the generation upstream was stopped
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert b" first" in messages[1]["body"]


def test_an_error_mid_stream_goes_out_with_the_end_of_the_stream():
    backend = FakeBackend(fail_after=1, error=Overloaded("replica lost"))
    body = {"model": "llm", "prompt": "a b c", "stream": True}
    messages = asyncio.run(_asgi_messages(create_app(backend), "/v1/completions", body))
    assert [m.get("more_body") for m in messages[1:]] == [True, False]
    error, done = messages[-1]["body"].decode().removesuffix("\n\n").split("\n\n")
    assert json.loads(error[6:])["error"]["message"] == "replica lost"
    assert done == "data: [DONE]"


def test_an_error_before_the_first_chunk_is_the_http_status():
    api = client(FakeBackend(fail_after=0, error=Overloaded("busy")))
    response = api.post("/v1/completions", json={"model": "llm", "prompt": "a", "stream": True})
    assert error_of(response, 503)["message"] == "busy"
    assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": "emb", "prompt": "x"}, 404, "model"),
        ("/v1/embeddings", {"model": "llm", "input": "x"}, 404, "model"),
        ("/v1/completions", {"model": "llm", "prompt": "x", "max_tokens": 17}, 400, "max_tokens"),
        ("/v1/completions", {"model": "llm", "prompt": "x" * 1001}, 400, "prompt"),
        (
            "/v1/completions",
            {"model": "llm", "prompt": "x", "logit_bias": {"a": 1}},
            400,
            "logit_bias",
        ),
        (
            "/v1/completions",
            {"model": "llm", "prompt": "x", "logit_bias": {"100": 1}},
            400,
            "logit_bias",
        ),
        ("/v1/completions", {"model": "llm", "prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
        ("/v1/chat/completions", {"model": "llm", "messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": "llm", "messages": [{"role": "user", "content": "x"}] * 4},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": "llm", "messages": [{"role": "user", "content": "x"}], "tools": []},
            400,
            "tools",
        ),
        ("/v1/embeddings", {"model": "emb", "input": [1, 2]}, 400, "input"),
        ("/v1/embeddings", {"model": "emb", "input": ""}, 400, "input"),
        ("/generate", {"prompt": "x", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ],
)
def test_bad_requests_get_error_objects_naming_the_parameter(path, body, status, param):
    assert error_of(client().post(path, json=body), status)["param"] == param


def test_routing_errors_are_error_objects_too():
    api = client()
    assert error_of(api.get("/v1/nothing"), 404)
    assert error_of(api.get("/v1/completions"), 405)
    assert error_of(api.post("/v1/completions", content=b"{not json"), 400)


def test_an_unexpected_failure_is_a_500_without_details(caplog):
    api = client(FakeBackend(fail_after=0, error=RuntimeError("secret internals")))
    with caplog.at_level(logging.ERROR):
        response = api.post("/v1/completions", json={"model": "llm", "prompt": "a"})
    error = error_of(response, 500)
    assert "secret" not in error["message"] and "secret internals" in caplog.text


def test_backend_api_errors_keep_their_status():
    api = client(FakeBackend(fail_after=0, error=APIError("prompt too long", "prompt")))
    assert error_of(api.post("/v1/completions", json={"model": "llm", "prompt": "a"}), 400)


def test_bodies_over_the_limit_are_413_with_or_without_content_length():
    api = client()
    big = json.dumps({"model": "llm", "prompt": "x" * 5000}).encode()
    assert error_of(api.post("/v1/completions", content=big), 413)

    def chunked(data: bytes):  # a generator body: sent without Content-Length
        yield from (data[i : i + 512] for i in range(0, len(data), 512))

    response = api.post(
        "/v1/completions", content=chunked(big), headers={"content-type": "application/json"}
    )
    assert "content-length" not in response.request.headers
    assert error_of(response, 413)
    small = json.dumps({"model": "llm", "prompt": "a b"}).encode()
    response = api.post(
        "/v1/completions", content=chunked(small), headers={"content-type": "application/json"}
    )
    assert response.json()["choices"][0]["text"] == " a b"


def test_api_keys_guard_every_route(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TEST_KEYS", "k1, k2")
    key_file = tmp_path / "keys"
    key_file.write_text("# ops team\nk3\n")
    keyring = app_keyring(APIKeys(env="TEST_KEYS", file=key_file))
    assert all(keyring.caller(key) is not None for key in ("k1", "k2", "k3"))
    app = create_app(FakeBackend(), keyring)
    api = TestClient(app, raise_server_exceptions=False)
    with caplog.at_level(logging.DEBUG):
        for path in ("/v1/models", "/generate?query=x"):
            missing = api.get(path)
            assert error_of(missing, 401)["code"] == "invalid_api_key"
            assert missing.headers["www-authenticate"] == "Bearer"
            assert error_of(api.get(path, headers={"Authorization": "Bearer k9"}), 401)
            assert api.get(path, headers={"Authorization": "Bearer k3"}).status_code == 200
    assert "k3" not in caplog.text and "k9" not in caplog.text


def test_no_keys_configured_means_an_open_api(monkeypatch):
    monkeypatch.delenv("TEST_KEYS", raising=False)
    assert app_keyring(APIKeys(env="TEST_KEYS")).open
    assert client().get("/v1/models").json()["data"][0]["id"] == "llm"


def test_embeddings_as_floats_and_base64():
    api = client()
    body = {"model": "emb", "input": ["ab", "abcd"]}
    floats = api.post("/v1/embeddings", json=body).json()
    assert [d["embedding"] for d in floats["data"]] == [[2, 1.5, -2], [4, 1.5, -2]]
    assert floats["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    encoded = api.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    decoded = [
        np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
        for d in encoded["data"]
    ]
    assert decoded == [d["embedding"] for d in floats["data"]]


def test_each_response_is_recorded_with_its_route_template_and_model():
    seen = []
    api = client(record=lambda scope, status, s: seen.append((scope, status)))
    api.get("/v1/models/llm")
    api.post("/v1/completions", json={"model": "llm", "prompt": "a"})
    api.post("/v1/completions", json={"model": "llm", "prompt": "a", "max_tokens": 99})
    routes = [(scope["route"].path, scope["state"].get("model"), status) for scope, status in seen]
    assert routes == [
        ("/v1/models/{model_id}", None, 200),
        ("/v1/completions", "llm", 200),
        ("/v1/completions", "llm", 400),
    ]


def test_triton_request_ids_are_unique_and_carry_the_http_request_id():
    backend = FakeBackend()
    api = client(backend)
    for _ in range(2):
        api.post(
            "/v1/completions",
            json={"model": "llm", "prompt": ["a", "b"]},
            headers={"x-request-id": "req-7"},
        )
    ids = [p.request_id for p in backend.params]
    assert len(set(ids)) == 4 and all(i.startswith("req-7.") for i in ids)


def test_the_openapi_schema_fuzzed_gives_no_server_error():
    """schemathesis against the app's own OpenAPI schema (in-process, fake backend): every
    generated request, valid or not, gets an answer below 500."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(FakeBackend()))
    assert not server_errors(schema, lambda case: case.call(), max_examples=60)
