"""OpenAI error objects with the right HTTP status, and FastAPI's handlers for them."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


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


class NotFound(APIError):
    status = 404


class TooLarge(APIError):
    status = 413


class InternalError(APIError):
    status = 500
    type = "server_error"


class Overloaded(APIError):
    status = 503
    type = "server_error"


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        # app.state.max_body_bytes is set from the config by the ingress.
        limit = getattr(request.app.state, "max_body_bytes", None)
        length = request.headers.get("content-length", "")
        if limit and length.isdigit() and int(length) > limit:
            return error_response(TooLarge(f"request body of {length} bytes exceeds {limit}"))
        return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, error: RequestValidationError):
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return error_response(APIError(f"{param}: {first['msg']}", param=param))
