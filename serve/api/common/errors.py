"""Error objects with the right HTTP status, and FastAPI's handlers for them.

Code raises an :class:`APIError` subclass; one set of handlers turns it, FastAPI's
validation errors (400, never 422) and anything unexpected (500, a generic message,
the details only in the log with the request id) into the error object of the API the
request's path belongs to: OpenAI's ``{"error": {"message", "type", "param", "code"}}``,
or under ``/v1/messages`` Anthropic's ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from serve.api.common import unsupported

log = logging.getLogger("ray.serve")


class APIError(Exception):
    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str] | None:
        return None


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(APIError):
    status = 404


class TooLarge(APIError):
    status = 413


class InternalError(APIError):
    status = 500
    type = "server_error"


class Overloaded(APIError):
    """Full or briefly unavailable: the client should retry (``Retry-After``)."""

    status = 503
    type = "server_error"
    retry_after_s = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class NotReady(Overloaded):
    """A configured model has no ready replica yet (``GET /health``)."""

    retry_after_s = 5


# pydantic names the union member that failed in an error's location ("str",
# "list[str]", "function-after[...]"): not part of the parameter's name.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|\w+[-\w]*\[.*\])$")


def _not_a_field(part) -> bool:
    return part in ("body", "query") or (isinstance(part, str) and bool(_UNION_MEMBER.match(part)))


def _specificity(error: dict) -> tuple[bool, int]:
    """Sort key of pydantic's errors, the one to tell the client first: a union field
    fails once per member, and "not a valid string" for the ``str`` member of
    ``str | list[str]`` hides the list member's real reason: a value's own error (the
    deepest first) goes before the type mismatches, which keep pydantic's order."""
    mismatch = error["type"].endswith("_type")
    return mismatch, 0 if mismatch else -len(error["loc"])


# Anthropic's error type of each status (its API's "Errors" page); 529 is its overload.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
MESSAGES_PATH = "/v1/messages"


def anthropic_body(error: APIError) -> dict:
    """Anthropic's error object; a status it names no type for is an
    ``invalid_request_error`` below 500 and an ``api_error`` from 500 on."""
    fallback = "invalid_request_error" if error.status < 500 else "api_error"
    kind = _ANTHROPIC_TYPES.get(error.status, fallback)
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def speaks_anthropic(path: str) -> bool:
    """Whether a request path is the Messages API's (its routes and any path below)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def body_builder(path: str) -> Callable[[APIError], dict]:
    """The error object of the API ``path`` belongs to: OpenAI's unless Anthropic's."""
    return anthropic_body if speaks_anthropic(path) else APIError.body


def route_path(scope: Scope) -> str:
    """The path the routes see (a Serve route prefix is the ASGI ``root_path``)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class ErrorResponse(JSONResponse):
    """An :class:`APIError` in the shape of the request's API, chosen when it is sent:
    the body-size middleware refuses a request before routing, with only the ASGI scope
    at hand, so the shape is read from the scope there and in the handlers alike."""

    def __init__(self, error: APIError):
        self.error = error
        super().__init__(error.body(), status_code=error.status, headers=error.headers())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        build = body_builder(route_path(scope))
        if build is not APIError.body:
            self.body = self.render(build(self.error))
            self.init_headers(self.error.headers())  # the new body's length
        await super().__call__(scope, receive, send)


def error_response(error: APIError) -> JSONResponse:
    return ErrorResponse(error)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, error: RequestValidationError):
        first = min(error.errors(), key=_specificity)
        param = ".".join(str(p) for p in first["loc"] if not _not_a_field(p)) or None
        message = first["msg"]
        # The reasons are OpenAI's fields' (the Messages API's schemas give their own).
        reason = None
        if first["type"] == "extra_forbidden" and not speaks_anthropic(route_path(request.scope)):
            reason = unsupported.reason(str(first["loc"][-1]))
        if reason:
            message = f"not supported: {reason}"
        return error_response(APIError(f"{param}: {message}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, error: StarletteHTTPException):
        # Routing errors (unknown path: 404, wrong method: 405) in OpenAI's shape too.
        api_error = APIError(str(error.detail))
        api_error.status = error.status_code
        return error_response(api_error)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception):
        log.exception(
            "unexpected error on %s (request %s)",
            request.url.path,
            request.headers.get("x-request-id"),
        )
        return error_response(InternalError("internal server error; see the server log"))
