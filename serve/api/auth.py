"""Optional API keys: ``Authorization: Bearer <key>`` on every API route, and on
Anthropic's Messages API its own header ``x-api-key: <key>`` as well.

Keys come from an environment variable (comma-separated) and/or a file (one per
line, ``#`` comments), never from the Serve config itself, so they stay out of
``serve deploy`` payloads and the dashboard. With no key configured the API is
open, which is right on loopback and wrong anywhere else (docs/operations.md says so).
Keys are never logged; comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from fastapi import Request

from serve.api.errors import Unauthorized


def load_api_keys(env: str | None, file: Path | None) -> frozenset[str]:
    keys: list[str] = []
    if env and os.environ.get(env):
        keys += os.environ[env].split(",")
    if file is not None:
        lines = file.expanduser().read_text().splitlines()
        keys += [line for line in lines if not line.lstrip().startswith("#")]
    return frozenset(k.strip() for k in keys if k.strip())


def check_api_key(keys: frozenset[str], authorization: str | None) -> None:
    """Raise 401 unless ``authorization`` is ``Bearer <one of keys>`` (or no keys are set)."""
    if not keys:
        return
    given = _bearer(authorization)
    if given is None:
        raise Unauthorized(
            "missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    if not _is_one_of(keys, given):
        raise Unauthorized("invalid API key", code="invalid_api_key")


def _bearer(authorization: str | None) -> str | None:
    scheme, _, given = (authorization or "").partition(" ")
    return given if scheme.lower() == "bearer" and given else None


def _is_one_of(keys: frozenset[str], given: str) -> bool:
    # compare_digest on every key: the time taken does not tell which key is close.
    matches = [hmac.compare_digest(given.strip().encode(), k.encode()) for k in keys]
    return any(matches)


def _keys(request: Request) -> frozenset[str]:
    return getattr(request.app.state, "api_keys", frozenset())


def key_owner(request: Request) -> str:
    """Who owns what a request stores (its Responses): the SHA-256 of the Bearer key it
    was let in with, never the key itself (stores may be read by others, Redis's
    included); ``""`` on an open API, where every request is the one owner. Call it
    after :func:`require_api_key` has let the request in."""
    if not _keys(request):
        return ""
    key = (_bearer(request.headers.get("authorization")) or "").strip()
    return hashlib.sha256(key.encode()).hexdigest()


async def require_api_key(request: Request) -> None:
    """FastAPI dependency; the ingress puts the loaded keys in ``app.state.api_keys``."""
    check_api_key(_keys(request), request.headers.get("authorization"))


async def require_messages_api_key(request: Request) -> None:
    """The Messages API's dependency: Anthropic's clients send ``x-api-key``; a Bearer
    key (OpenAI's way, and Anthropic's SDK's ``auth_token``) is taken too. Either header
    holding a key lets the request in."""
    keys = _keys(request)
    if not keys:
        return
    given = [request.headers.get("x-api-key"), _bearer(request.headers.get("authorization"))]
    given = [key for key in given if key and key.strip()]
    if not given:
        raise Unauthorized(
            "missing API key: send the header 'x-api-key: <key>' "
            "(or 'Authorization: Bearer <key>')",
            code="invalid_api_key",
        )
    if not any([_is_one_of(keys, key) for key in given]):  # a list: every key compared
        raise Unauthorized("invalid API key", code="invalid_api_key")
