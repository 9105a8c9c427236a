"""Per-tenant rate limits: a tenant's requests per minute, as OpenAI and Anthropic
limit theirs, held across every ingress replica of the app.

Each limit is a token bucket: it holds up to the limit and refills at the limit per
minute, so a tenant idle for a minute may send its whole minute's requests at once,
and one at the limit gets the next request in as soon as one has refilled (what the
``retry-after`` of a 429 says). Two stores keep the buckets: :class:`MemoryBuckets`
(in this process: each ingress replica allows the whole limit, so it holds for an app
of one ingress replica) and :class:`RedisBuckets` (one bucket per tenant in a Redis,
taken from atomically by a Lua script on the Redis's own clock: every replica shares
it). A Redis that cannot be reached lets requests in or refuses them (503), as
``rate_limits.on_store_error`` says, and the log says which, once a minute.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

from serve.api.errors import APIError, Overloaded

log = logging.getLogger("ray.serve")

# How long one Redis call may take before the store counts as unreachable.
TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Quota:
    """One limit as a request found it: what the ``x-ratelimit-*`` headers say."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again
    retry_after_s: float = 0.0  # 0: this request was let in

    @property
    def allowed(self) -> bool:
        return self.retry_after_s == 0.0


class RateLimited(APIError):
    """OpenAI's 429 (Anthropic's ``rate_limit_error`` on /v1/messages)."""

    status = 429
    type = "requests"

    def __init__(self, tenant: str, quota: Quota):
        super().__init__(
            f"rate limit reached for tenant {tenant!r}: {quota.limit} requests per minute; "
            f"retry in {quota.retry_after_s:.1f} s",
            code="rate_limit_exceeded",
        )
        self.quota = quota

    def headers(self) -> dict[str, str]:
        # Whole seconds, rounded up: a client that waits that long gets in.
        return {"retry-after": str(max(1, math.ceil(self.quota.retry_after_s)))}


class Buckets(Protocol):
    async def take(self, name: str, per_minute: int) -> Quota:
        """Takes one request from the bucket ``name`` of ``per_minute``: a Quota whose
        ``retry_after_s`` is 0 when it was let in."""


def _take(tokens: float, per_minute: int) -> tuple[float, float]:
    """The bucket after one request is taken (if one is there), and the retry-after
    (0: taken). The Lua script below does the same in Redis."""
    if tokens >= 1.0:
        return tokens - 1.0, 0.0
    return tokens, (1.0 - tokens) * 60.0 / per_minute


def _quota(tokens: float, per_minute: int, retry_after_s: float) -> Quota:
    """What a bucket holding ``tokens`` after a take says."""
    return Quota(per_minute, int(tokens), (per_minute - tokens) * 60.0 / per_minute, retry_after_s)


class MemoryBuckets:
    """Buckets in this process (see the module's docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # name: (tokens, at)

    async def take(self, name: str, per_minute: int) -> Quota:
        now = self._clock()
        tokens, at = self._buckets.get(name, (float(per_minute), now))
        tokens = min(float(per_minute), tokens + (now - at) * per_minute / 60.0)
        tokens, retry = _take(tokens, per_minute)
        self._buckets[name] = (tokens, now)
        return _quota(tokens, per_minute, retry)


# KEYS[1]: the bucket; ARGV[1]: requests per minute. The bucket's tokens and time live
# in a hash that expires once it would be full anyway; TIME is the Redis's clock, one
# for every replica. Returns {tokens after, retry-after s} as strings (Lua numbers
# would come back as truncated integers).
_TAKE = """
local per_minute = tonumber(ARGV[1])
local rate = per_minute / 60.0
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local held = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(held[1]) or per_minute
local at = tonumber(held[2]) or now
tokens = math.min(per_minute, tokens + math.max(0, now - at) * rate)
local retry = 0
if tokens >= 1 then tokens = tokens - 1 else retry = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(per_minute / rate * 1000) + 1000)
return {tostring(tokens), tostring(retry)}
"""


class RedisBuckets:
    """Buckets in a Redis, shared by every ingress replica (see the module's docstring).

    ``fail_open``: whether a request is let in when the Redis cannot be reached."""

    def __init__(self, url: str, key_prefix: str, fail_open: bool = True):
        # Imported here: an app on the memory store never needs the client.
        import redis.asyncio

        self._redis = redis.asyncio.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self._script = self._redis.register_script(_TAKE)
        self._unreachable = (redis.ConnectionError, redis.TimeoutError)
        self.key_prefix, self.fail_open = key_prefix, fail_open
        self._complained_at = float("-inf")

    async def take(self, name: str, per_minute: int) -> Quota:
        try:
            tokens, retry = await self._script(keys=[self.key_prefix + name], args=[per_minute])
        except self._unreachable as error:
            return self._unlimited(per_minute, error)
        return _quota(float(tokens), per_minute, float(retry))

    async def close(self) -> None:
        await self._redis.aclose()

    def _unlimited(self, per_minute: int, error: Exception) -> Quota:
        if time.monotonic() - self._complained_at > 60:
            self._complained_at = time.monotonic()
            what = "letting requests in" if self.fail_open else "refusing requests (503)"
            log.warning("rate limits (Redis) unreachable, %s: %s", what, error)
        if not self.fail_open:
            raise Overloaded("the rate limits' store is not available; retry")
        return Quota(per_minute, per_minute, 0.0)


def duration(seconds: float) -> str:
    """OpenAI's form of a reset time in its headers: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


def quota_headers(quota: Quota, anthropic: bool) -> list[tuple[bytes, bytes]]:
    """The headers every answer under a limit carries: OpenAI's ``x-ratelimit-*``, or
    Anthropic's ``anthropic-ratelimit-*`` (its reset an RFC 3339 time) on its API."""
    if anthropic:
        reset = datetime.now(UTC) + timedelta(seconds=quota.reset_s)
        pairs = [
            ("anthropic-ratelimit-requests-limit", quota.limit),
            ("anthropic-ratelimit-requests-remaining", quota.remaining),
            ("anthropic-ratelimit-requests-reset", reset.strftime("%Y-%m-%dT%H:%M:%SZ")),
        ]
    else:
        pairs = [
            ("x-ratelimit-limit-requests", quota.limit),
            ("x-ratelimit-remaining-requests", quota.remaining),
            ("x-ratelimit-reset-requests", duration(quota.reset_s)),
        ]
    return [(name.encode(), str(value).encode()) for name, value in pairs]
