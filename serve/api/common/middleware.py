"""Pure ASGI middleware of the front door: body size limit, request accounting.

Pure ASGI (not ``@app.middleware("http")``) so that streamed responses pass
through untouched and a client's disconnect still reaches the route.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.api.common.errors import TooLarge, error_response, route_path, speaks_anthropic
from serve.api.common.limits import in_background, quota_headers

_BODY_METHODS = {"POST", "PUT", "PATCH"}


class BodySizeLimit:
    """A body over ``app.state.max_body_bytes`` gets a 413 before any route runs.

    A ``Content-Length`` over the limit is refused at once; a chunked body (no
    length) is read up to the limit and refused as soon as it passes it. Starlette
    has no such limit and uvicorn's applies to headers only, hence this class. The
    body is buffered (at most the limit) and replayed to the app; later ``receive``
    calls go to the client, so a disconnect still cancels a stream.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = getattr(scope.get("app").state, "max_body_bytes", None) if "app" in scope else None
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS or not limit:
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await _refuse(scope, send, f"request body of {int(length)} bytes exceeds {limit}")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await _refuse(scope, send, f"request body exceeds {limit} bytes")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(scope: Scope, send: Send, message: str) -> None:
    response = error_response(TooLarge(message))
    await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def request_state(request: Request, name: str, default=None):
    """``request.state.<name>``, or ``default`` where the request has none: read from the
    scope's dict behind ``request.state`` (Starlette's), whose ``getattr`` raises and
    formats an ``AttributeError`` for every name not set, several times per request."""
    return request.scope.get("state", {}).get(name, default)


def on_answer_end(request: Request, give_back: Callable[[], object]) -> None:
    """Calls ``give_back`` (awaited in the background where it is async) once the
    request's answer has ended, streamed or whole, or its client left:
    :class:`RequestRecorder` does."""
    ends = request_state(request, "on_end")
    if ends is None:
        request.state.on_end = ends = []
    ends.append(give_back)


class RequestRecorder:
    """Calls ``app.state.record_response(scope, status, seconds)`` once a response's
    last byte is out or the client left (status 499, as nginx logs it); routes put
    the request's model in ``request.state.model``. At the response's start it adds
    the rate-limit headers of the tenant's limit the request was held to
    (``request.state.quotas``): one wrapper of ``send`` for both, since every chunk of
    a stream goes through it. At the end it gives back the seats the request held
    (:func:`on_answer_end`)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = getattr(scope["app"].state, "record_response", None) if "app" in scope else None
        start = time.monotonic()
        status = 500  # what the client sees if the app fails before answering

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                quotas = scope.get("state", {}).get("quotas")
                if quotas:
                    anthropic = speaks_anthropic(route_path(scope))
                    headers = [*message.get("headers", []), *quota_headers(quotas, anthropic)]
                    message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            for give_back in scope.get("state", {}).get("on_end", ()):
                ended = give_back()  # seats: the tenant's at once, a fair share's
                if inspect.isawaitable(ended):
                    in_background(ended)
            if record is not None:
                record(scope, status, time.monotonic() - start)
