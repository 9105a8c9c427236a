"""The app's stored responses in memory, shared by every ingress replica: one Serve
replica holds them (:class:`ResponseStoreReplica`), the ingress reaches it through
:class:`DeploymentStore`, and :func:`open_response_store` picks the store the
config names.

The ingress replicas turn records to JSON and back, each for its own requests; the
one store replica only keeps the text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException

from serve.api.common.errors import Overloaded
from serve.api.openai.responses.store import (
    TIMEOUT_S,
    MemoryStore,
    RecordTooLarge,
    RedisStore,
    ResponseStore,
    to_json,
)
from serve.config import RateLimitsConfig, ResponsesConfig

log = logging.getLogger("ray.serve")


class ResponseStoreReplica:
    """Plain class; :func:`serve.app.build_app` makes it a one-replica deployment.
    A :class:`MemoryStore` of JSON texts."""

    def __init__(self, max_bytes: int, ttl_s: float):
        self._store = MemoryStore(max_bytes, ttl_s)

    async def put(self, response_id: str, text: str) -> None:
        self._store.put_text(response_id, text)

    async def get(self, response_id: str) -> str | None:
        return self._store.get_text(response_id)

    async def delete(self, response_id: str) -> bool:
        return self._store.delete_text(response_id)


class DeploymentStore:
    """:class:`serve.api.openai.responses.store.ResponseStore` over the DeploymentHandle of the
    app's :class:`ResponseStoreReplica`. A store that does not answer is a 503
    (:class:`serve.api.common.errors.Overloaded`); a record too large for it is
    :class:`serve.api.openai.responses.store.RecordTooLarge`, as from a local MemoryStore."""

    def __init__(self, handle, timeout_s: float = TIMEOUT_S):
        # A timeout of our own: Serve holds a call while the replica restarts.
        self._handle, self._timeout_s = handle, timeout_s

    async def put(self, response_id: str, record: dict) -> None:
        await self._call("put", self._handle.put.remote(response_id, to_json(record)))

    async def get(self, response_id: str) -> dict | None:
        text = await self._call("get", self._handle.get.remote(response_id))
        return None if text is None else json.loads(text)

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete", self._handle.delete.remote(response_id))

    async def _call(self, what: str, response):
        try:
            return await asyncio.wait_for(response, self._timeout_s)
        except RayTaskError as error:
            if isinstance(error.cause, RecordTooLarge):
                raise error.cause from None  # its own message, not the remote traceback
            raise  # a fault of the store's own code: a 500, with the traceback in the log
        except (RayError, RayServeException, asyncio.TimeoutError) as error:
            # The replica died, is restarting, or is not deployed yet.
            log.warning("response store: %s failed: %s %s", what, type(error).__name__, error)
            raise Overloaded("the response store is not available; retry") from None


def open_response_store(
    config: ResponsesConfig, handle=None, environ: Mapping[str, str] = os.environ
) -> ResponseStore | None:
    """The store ``config`` names (memory: over ``handle``, the app's
    :class:`ResponseStoreReplica`); None for ``store: none``."""
    if config.store == "memory":
        if handle is None:
            raise ValueError(
                "responses.store memory needs the handle of the app's ResponseStore "
                "deployment (serve.app.build_app binds it)"
            )
        return DeploymentStore(handle)
    if config.store == "redis":
        return RedisStore(redis_url(config, environ), config.ttl_s, config.key_prefix)
    return None


def redis_url(
    config: ResponsesConfig | RateLimitsConfig,
    environ: Mapping[str, str] = os.environ,
    section: str = "responses",
) -> str:
    """``redis_url``, or the value of the variable ``redis_url_env`` names (of the
    config's ``section``: responses, rate_limits)."""
    if config.redis_url:
        return config.redis_url
    url = environ.get(config.redis_url_env or "", "")
    if not url:
        raise ValueError(
            f"{section}.redis_url_env names {config.redis_url_env}, which is unset or empty "
            "in the ingress's environment: set it (runtime_env env_vars, or the environment "
            "of `ray start`) to the Redis URL, e.g. redis://:password@host:6379/0"
        )
    return url
