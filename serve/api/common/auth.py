"""Optional API keys: ``Authorization: Bearer <key>`` on every API route, and on
Anthropic's Messages API its own header ``x-api-key: <key>`` as well.

Who a key is, plain or a named tenant's, is the app's :class:`serve.api.common.keyring.Keyring`
(``app.state.keyring``); the dependencies here put the request's
:class:`serve.api.common.keyring.Caller` in ``request.state.caller`` for the routes (the
models a tenant may use, the owner of what it stores). Keys come from the environment
and from files, never from the Serve config itself, so they stay out of ``serve
deploy`` payloads and the dashboard. With no key configured the API is open, which is
right on loopback and wrong anywhere else (docs/operations.md says so). Keys are never
logged.
"""

from __future__ import annotations

import functools
import os

from fastapi import Request

from serve.api.common.errors import Unauthorized
from serve.api.common.keyring import ANYONE, Caller, Keyring
from serve.api.common.limits import RateLimited, TooManyAtOnce
from serve.api.common.middleware import on_answer_end, request_state
from serve.config import APIKeys


def app_keyring(api_keys: APIKeys, model_ids: list[str] | None = None) -> Keyring:
    """The keyring ``api_keys`` (the Serve config's) names, read here: a keys or tenants
    file that is missing or wrong raises, so the replica does not start; its tenants
    may name only ``model_ids`` (None: not checked)."""
    plain = os.environ.get(api_keys.env, "").split(",") if api_keys.env else []
    try:
        return Keyring(plain, api_keys.file, api_keys.tenants_file, model_ids)
    except OSError as error:
        raise ValueError(
            f"api_keys: cannot read {error.filename}: {error.strerror} (api_keys.file "
            "and api_keys.tenants_file must be on every node that runs an ingress replica)"
        ) from None


def caller(request: Request) -> Caller:
    """Whom the request's key let in (:data:`serve.api.common.keyring.ANYONE` on an open API,
    or on a route that needs no key)."""
    return request_state(request, "caller", ANYONE)


def key_owner(request: Request) -> str:
    """Who owns what a request stores (its Responses): a named tenant, or the SHA-256 of
    a plain key, never the key itself (stores may be read by others, Redis's
    included); ``""`` on an open API, where every request is the one owner."""
    return caller(request).owner


def _bearer(authorization: str | None) -> str | None:
    scheme, _, given = (authorization or "").partition(" ")
    return given if scheme.lower() == "bearer" and given.strip() else None


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless the Bearer key is one of the keyring's; then the
    caller's tenant is held to its limits."""
    keyring: Keyring = request.app.state.keyring
    if keyring.open:
        await _admit_anyone(request, keyring)
        return
    request.state.caller = _bearer_caller(request, keyring)
    await _admit(request)


async def require_api_key_alone(request: Request) -> None:
    """:func:`require_api_key` without the tenant's limits, for what the operator asks
    (``GET /metrics``): a scrape every 15 s would take four of a tenant's requests per
    minute, and a seat among its requests at once, from the traffic they bound."""
    keyring: Keyring = request.app.state.keyring
    if not keyring.open:
        request.state.caller = _bearer_caller(request, keyring)


def _bearer_caller(request: Request, keyring: Keyring) -> Caller:
    given = _bearer(request.headers.get("authorization"))
    if given is None:
        raise Unauthorized(
            "missing API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    return _let_in(keyring, [given])


async def require_messages_api_key(request: Request) -> None:
    """The Messages API's dependency: Anthropic's clients send ``x-api-key``; a Bearer
    key (OpenAI's way, and Anthropic's SDK's ``auth_token``) is taken too. Either header
    holding a key lets the request in."""
    keyring: Keyring = request.app.state.keyring
    if keyring.open:
        await _admit_anyone(request, keyring)
        return
    given = [request.headers.get("x-api-key"), _bearer(request.headers.get("authorization"))]
    given = [key for key in given if key and key.strip()]
    if not given:
        raise Unauthorized(
            "missing API key: send the header 'x-api-key: <key>' "
            "(or 'Authorization: Bearer <key>')",
            code="invalid_api_key",
        )
    request.state.caller = _let_in(keyring, given)
    await _admit(request)


async def _admit_anyone(request: Request, keyring: Keyring) -> None:
    """An open API's request: the ``default`` tenant's limits, where the tenants file
    sets them (none otherwise, and nothing to do)."""
    anyone = keyring.caller(None)
    if anyone != ANYONE:
        request.state.caller = anyone
        await _admit(request)


async def _admit(request: Request) -> None:
    """Holds the caller's tenant to its requests per minute (the quota goes in
    ``request.state.quotas`` for the headers of the answer, 429s included) and to its
    requests at once (a seat, given back when the answer has ended:
    serve.api.common.middleware.on_answer_end); a 429 past either. Its tokens per
    minute are held where a request reaches an engine (serve/api/common/metered.py)."""
    tenant = caller(request)
    buckets = getattr(request.app.state, "buckets", None)
    if buckets is None:
        return
    if tenant.requests_per_minute is not None:
        quota = await buckets.take(f"{tenant.tenant}:requests", tenant.requests_per_minute)
        request.state.quotas = [quota]
        if not quota.allowed:
            raise RateLimited(tenant.tenant, quota)
    if tenant.max_concurrent_requests is not None:
        seats = f"{tenant.tenant}:at-once"
        ticket = await buckets.enter(seats, tenant.max_concurrent_requests)
        if ticket is None:
            raise TooManyAtOnce(tenant.tenant, tenant.max_concurrent_requests)
        on_answer_end(request, functools.partial(buckets.leave, seats, ticket))


def _let_in(keyring: Keyring, given: list[str]) -> Caller:
    for key in given:
        found = keyring.caller(key)
        if found is not None:
            return found
    raise Unauthorized("invalid API key", code="invalid_api_key")
