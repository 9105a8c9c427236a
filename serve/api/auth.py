"""Optional API keys: ``Authorization: Bearer <key>`` on every API route.

Keys come from an environment variable (comma-separated) and/or a file (one per
line, ``#`` comments), never from the Serve config itself, so they stay out of
``serve deploy`` payloads and the dashboard. With no key configured the API is
open, which is right on loopback and wrong anywhere else (docs/operations.md says so).
Keys are never logged; comparison is constant-time.
"""

from __future__ import annotations

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
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized(
            "missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    # compare_digest on every key: the time taken does not tell which key is close.
    matches = [hmac.compare_digest(given.strip().encode(), k.encode()) for k in keys]
    if not any(matches):
        raise Unauthorized("invalid API key", code="invalid_api_key")


async def require_api_key(request: Request) -> None:
    """FastAPI dependency; the ingress puts the loaded keys in ``app.state.api_keys``."""
    check_api_key(
        getattr(request.app.state, "api_keys", frozenset()), request.headers.get("authorization")
    )
