"""The FastAPI application of the front door, built for one backend.

Built per ingress replica (Serve's late-bound ``__serve_build_asgi_app__``), so the
app holds its backend, limits and keys in ``app.state`` and nothing is a
module-level singleton; the route tests build one over a fake backend.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from serve.api.anthropic.routes import messages_router
from serve.api.common.backend import Backend
from serve.api.common.errors import install_handlers
from serve.api.common.keyring import Keyring
from serve.api.common.limits import Buckets, MemoryBuckets
from serve.api.common.middleware import BodySizeLimit, RequestRecorder
from serve.api.openai.responses.routes import responses_router
from serve.api.openai.routes import router
from serve.api.operations import operations_router


def create_app(
    backend: Backend,
    keyring: Keyring | None = None,
    record_response: Callable | None = None,
    buckets: Buckets | None = None,
) -> FastAPI:
    app = FastAPI(
        title="triton-ray-llm",
        description="OpenAI-compatible API over Triton Inference Server in Ray Serve replicas",
    )
    app.state.backend = backend
    app.state.max_body_bytes = backend.config.max_body_bytes
    app.state.keyring = keyring or Keyring()  # none: an open API
    app.state.buckets = buckets or MemoryBuckets()  # the tenants' rate limits
    app.state.record_response = record_response
    app.add_middleware(BodySizeLimit)
    app.add_middleware(RequestRecorder)  # outermost: it sees the 413s too
    install_handlers(app)
    app.include_router(router)  # chat and text completions, models, embeddings, /generate
    app.include_router(responses_router)
    app.include_router(messages_router)
    app.include_router(operations_router)
    return app
