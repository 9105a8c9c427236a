"""Where stored responses live (OpenAI's Responses API: ``store: true``,
``previous_response_id``, ``GET`` / ``DELETE /v1/responses/{id}``).

The routes see one small interface, :class:`ResponseStore`, over a record that is a
JSON-serialisable dict. Two stores implement it here: :class:`MemoryStore` (in one
process; :mod:`serve.deployments.response_store` puts it in a Serve deployment that
every ingress replica of the app shares) and :class:`RedisStore` (outside the app:
records outlive its restarts and redeploys). Either keeps a record ``ttl_s`` after it
was stored (OpenAI keeps responses 30 days), counted from the ``put``, never
refreshed by a ``get``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from serve.api.common.errors import Overloaded

log = logging.getLogger("ray.serve")

# How long one store call may take: either store answers from memory, so a miss means
# it is down or restarting, and the client is better told to retry than kept waiting.
TIMEOUT_S = 5.0


class ResponseStore(Protocol):
    async def put(self, response_id: str, record: dict) -> None:
        """Stores ``record`` (a JSON-serialisable dict) under ``response_id``, replacing
        any record there. Raises :class:`RecordTooLarge` (the memory store) and
        :class:`serve.api.common.errors.Overloaded` (the store is not reachable now)."""

    async def get(self, response_id: str) -> dict | None:
        """The record stored under ``response_id``; None where it was never stored or
        was deleted, expired or evicted. Raises :class:`serve.api.common.errors.Overloaded`."""

    async def delete(self, response_id: str) -> bool:
        """Forgets the record; False where there was none. Raises
        :class:`serve.api.common.errors.Overloaded`."""


class RecordTooLarge(ValueError):
    """One record's JSON is larger than the whole memory store may hold."""


def to_json(record: dict) -> str:
    """The text a store keeps: compact, and UTF-8 rather than ``\\u`` escapes (a
    non-Latin answer takes half the bytes or fewer)."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


class MemoryStore:
    """Records in this process, as JSON text: a stored record cannot change when its
    caller's dict does, and its size is exact. Bounded by the records' total size
    (least recently used out first) and by age (``ttl_s`` after its put).

    Two OrderedDicts, one per order: recency (a ``get`` refreshes it; eviction pops its
    front) and age (a ``get`` does not; expiry pops its front). cachetools' TTLCache
    (with ``getsizeof``) would do the same, but the project does not otherwise depend
    on cachetools, and these few lines cost less than a dependency in every image.
    """

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        self._texts: OrderedDict[str, str] = OrderedDict()  # least recently used first
        self._deadlines: OrderedDict[str, float] = OrderedDict()  # oldest put first
        self.size = 0  # bytes of the texts held

    async def put(self, response_id: str, record: dict) -> None:
        self.put_text(response_id, to_json(record))

    async def get(self, response_id: str) -> dict | None:
        text = self.get_text(response_id)
        return None if text is None else json.loads(text)

    async def delete(self, response_id: str) -> bool:
        return self.delete_text(response_id)

    def put_text(self, response_id: str, text: str) -> None:
        size = len(text.encode())
        if size > self.max_bytes:
            raise RecordTooLarge(
                f"response {response_id}: {size} bytes of JSON, more than the store's "
                f"{self.max_bytes} (responses.max_memory_mb)"
            )
        self.delete_text(response_id)
        self._expire()
        while self.size + size > self.max_bytes:
            self._forget(next(iter(self._texts)))
        self._texts[response_id] = text
        self._deadlines[response_id] = self._clock() + self.ttl_s
        self.size += size

    def get_text(self, response_id: str) -> str | None:
        self._expire()
        text = self._texts.get(response_id)
        if text is not None:
            self._texts.move_to_end(response_id)
        return text

    def delete_text(self, response_id: str) -> bool:
        self._expire()
        if response_id not in self._texts:
            return False
        self._forget(response_id)
        return True

    def __len__(self) -> int:
        return len(self._texts)

    def _expire(self) -> None:
        now = self._clock()
        while self._deadlines and next(iter(self._deadlines.values())) <= now:
            self._forget(next(iter(self._deadlines)))

    def _forget(self, response_id: str) -> None:
        self.size -= len(self._texts.pop(response_id).encode())
        del self._deadlines[response_id]


class OwnedStore:
    """A :class:`ResponseStore` as one owner (an API key) sees it: each id is stored
    under the owner's name, so another owner's ``get`` and ``delete`` of it find
    nothing, exactly as for an id never stored (no 403 that would confirm it exists).
    The open API (no keys) has one owner, ``""``, whose ids are stored as they are."""

    def __init__(self, store: ResponseStore, owner: str):
        self._store, self._prefix = store, f"{owner}/" if owner else ""

    async def put(self, response_id: str, record: dict) -> None:
        await self._store.put(self._prefix + response_id, record)

    async def get(self, response_id: str) -> dict | None:
        return await self._store.get(self._prefix + response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._store.delete(self._prefix + response_id)


DEFAULT_KEY_PREFIX = "tritonllm:responses:"


class RedisStore:
    """Records in a Redis, one key each (``key_prefix`` + id) that Redis itself expires.

    The Redis may be the one Ray's GCS fault tolerance uses: the prefix keeps our keys
    apart from Ray's. A Redis that cannot be reached (down, restarting, too slow) is a
    503 for the client (:class:`serve.api.common.errors.Overloaded`), with the reason in the log.
    """

    def __init__(self, url: str, ttl_s: float, key_prefix: str = DEFAULT_KEY_PREFIX):
        # Imported here: the GPU image installs the project without its dependencies,
        # and an app on the memory store never needs the client.
        import redis.asyncio

        self._redis = redis.asyncio.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self._unreachable = (redis.ConnectionError, redis.TimeoutError)
        self.key_prefix = key_prefix
        self._ttl_ms = max(1, round(ttl_s * 1000))  # PX, not EX: ttl_s may be fractional

    async def put(self, response_id: str, record: dict) -> None:
        text = to_json(record)
        await self._call("put", self._redis.set(self._key(response_id), text, px=self._ttl_ms))

    async def get(self, response_id: str) -> dict | None:
        text = await self._call("get", self._redis.get(self._key(response_id)))
        return None if text is None else json.loads(text)

    async def delete(self, response_id: str) -> bool:
        return bool(await self._call("delete", self._redis.delete(self._key(response_id))))

    async def close(self) -> None:
        await self._redis.aclose()

    def _key(self, response_id: str) -> str:
        return f"{self.key_prefix}{response_id}"

    async def _call(self, what: str, command):
        try:
            return await command
        except self._unreachable as error:
            log.warning("response store (Redis): %s failed: %s", what, error)
            raise Overloaded("the response store is not available; retry") from None
