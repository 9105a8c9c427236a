"""OpenAI error objects with the right HTTP status, and FastAPI's handlers for them.

Code raises an :class:`APIError` subclass; one set of handlers turns it, FastAPI's
validation errors (400, never 422) and anything unexpected (500, a generic message,
the details only in the log with the request id) into
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.api import unsupported

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


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, error: RequestValidationError):
        first = min(error.errors(), key=_specificity)
        param = ".".join(str(p) for p in first["loc"] if not _not_a_field(p)) or None
        message = first["msg"]
        if first["type"] == "extra_forbidden" and unsupported.reason(str(first["loc"][-1])):
            message = f"not supported: {unsupported.reason(str(first['loc'][-1]))}"
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
