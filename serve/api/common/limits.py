"""Per-tenant rate limits, held across every ingress replica of the app: a tenant's
requests and tokens per minute, as OpenAI and Anthropic limit theirs, and its requests
at once.

Each per-minute limit is a token bucket: it holds up to the limit and refills at the
limit per minute, so a tenant idle for a minute may send its whole minute at once, and
one at the limit gets in as soon as enough has refilled (what the ``retry-after`` of a
429 says). A request takes one from the requests' bucket; tokens are taken as a request
reaches an engine and settled at its end (serve/api/common/metered.py). Requests at once are
seats, each held until its answer has ended.

Two stores keep them: :class:`MemoryBuckets` (in this process: each ingress replica
allows the whole limit, so it holds for an app of one ingress replica) and
:class:`RedisBuckets` (one bucket, one set of seats per tenant in a Redis, changed
atomically by Lua scripts on the Redis's own clock: every replica shares them). A
Redis that cannot be reached lets requests in or refuses them (503), as
``rate_limits.on_store_error`` says, and the log says which, once a minute.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

from serve.api.common.errors import APIError, Overloaded

log = logging.getLogger("ray.serve")

# How long one Redis call may take before the store counts as unreachable.
TIMEOUT_S = 2.0
HEALTH_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class Quota:
    """One limit as a request found it: what the ``x-ratelimit-*`` headers say."""

    kind: str  # "requests" or "tokens": which headers it fills
    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again
    retry_after_s: float = 0.0  # 0: this request was let in

    @property
    def allowed(self) -> bool:
        return self.retry_after_s == 0.0


class RateLimited(APIError):
    """OpenAI's 429 (Anthropic's ``rate_limit_error`` on /v1/messages); its ``type`` is
    the limit's kind, as OpenAI's are (``requests``, ``tokens``)."""

    status = 429

    def __init__(self, tenant: str, quota: Quota, wanted: int = 1):
        self.type = quota.kind
        what = f"{quota.limit} {quota.kind} per minute"
        if quota.kind == "tokens":  # OpenAI's figures: the limit and what was asked
            what += f", this request asks {wanted} (prompt + max_tokens)"
        if math.isinf(quota.retry_after_s):  # no wait gets it in: OpenAI's "too large"
            message = f"request too large for tenant {tenant!r}: {what}; ask for fewer"
        else:
            message = (
                f"rate limit reached for tenant {tenant!r}: {what}; "
                f"retry in {quota.retry_after_s:.1f} s"
            )
        super().__init__(message, code="rate_limit_exceeded")
        self.quota = quota

    def headers(self) -> dict[str, str]:
        if math.isinf(self.quota.retry_after_s):
            return {}
        # Whole seconds, rounded up: a client that waits that long gets in.
        return {"retry-after": str(max(1, math.ceil(self.quota.retry_after_s)))}


class TooManyAtOnce(APIError):
    """A tenant's requests at once past its ``max_concurrent_requests``: a 429 whose
    ``retry-after`` is a guess (one ends when it ends)."""

    status = 429
    type = "requests"

    def __init__(self, tenant: str, limit: int):
        super().__init__(
            f"too many requests at once for tenant {tenant!r}: {limit} at most; retry when "
            "one has ended",
            code="rate_limit_exceeded",
        )

    def headers(self) -> dict[str, str]:
        return {"retry-after": "1"}


class Buckets(Protocol):
    fail_open: bool  # whether requests are let in while the store cannot be reached

    async def reachable_now(self) -> bool:
        """Whether the store can be reached now."""

    async def take(
        self, name: str, per_minute: int, amount: int = 1, kind: str = "requests"
    ) -> Quota:
        """Takes ``amount`` from the bucket ``name`` of ``per_minute``: a Quota whose
        ``retry_after_s`` is 0 when it was let in (infinite: ``amount`` is more than the
        bucket holds when full)."""

    async def settle(self, name: str, per_minute: int, amount: int) -> None:
        """Takes ``amount`` whatever the bucket holds (a request that used more than it
        took; below 0, the next waits until it has refilled), or gives ``-amount`` back."""

    async def enter(self, name: str, limit: int) -> str | None:
        """A seat among at most ``limit`` requests at once (its ticket), or None when
        they are all taken; :meth:`leave` gives it back."""

    async def leave(self, name: str, ticket: str) -> None:
        """Gives back the seat of ``ticket``."""


def _take(tokens: float, per_minute: int, amount: int, force: bool) -> tuple[float, float]:
    """The bucket after ``amount`` is taken (if it is there, or ``force``), and the
    retry-after (0: taken). The Lua script below does the same in Redis."""
    if force or amount <= tokens:
        return min(float(per_minute), tokens - amount), 0.0
    if amount > per_minute:
        return tokens, math.inf
    return tokens, (amount - tokens) * 60.0 / per_minute


def _quota(kind: str, tokens: float, per_minute: int, retry_after_s: float) -> Quota:
    """What a bucket holding ``tokens`` after a take says (below 0 after a request that
    used more than it reserved: the next waits until it is paid back)."""
    reset_s = (per_minute - tokens) * 60.0 / per_minute
    return Quota(kind, per_minute, max(0, int(tokens)), reset_s, retry_after_s)


class MemoryBuckets:
    """Buckets in this process (see the module's docstring)."""

    fail_open = True

    async def reachable_now(self) -> bool:
        return True

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # name: (tokens, at)
        self._seats: dict[str, set[str]] = {}  # name: the tickets of requests at once

    async def enter(self, name: str, limit: int) -> str | None:
        seats = self._seats.setdefault(name, set())
        if len(seats) >= limit:
            return None
        ticket = uuid.uuid4().hex
        seats.add(ticket)
        return ticket

    async def leave(self, name: str, ticket: str) -> None:
        self._seats.get(name, set()).discard(ticket)

    async def take(
        self, name: str, per_minute: int, amount: int = 1, kind: str = "requests"
    ) -> Quota:
        tokens, retry = self._take(name, per_minute, amount, False)
        return _quota(kind, tokens, per_minute, retry)

    async def settle(self, name: str, per_minute: int, amount: int) -> None:
        self._take(name, per_minute, amount, True)

    def _take(self, name: str, per_minute: int, amount: int, force: bool):
        now = self._clock()
        tokens, at = self._buckets.get(name, (float(per_minute), now))
        tokens = min(float(per_minute), tokens + (now - at) * per_minute / 60.0)
        tokens, retry = _take(tokens, per_minute, amount, force)
        self._buckets[name] = (tokens, now)
        return tokens, retry


# KEYS[1]: the bucket; ARGV: the limit per minute, the amount to take, 1 to take it
# whatever the bucket holds (a settlement; a negative amount gives back). The bucket's
# tokens and time live in a hash that expires once it would be full anyway; TIME is
# the Redis's clock, one for every replica. Returns {tokens after, retry-after s} as
# strings (Lua numbers would come back as truncated integers; "inf": never fits).
_TAKE = """
local per_minute = tonumber(ARGV[1])
local amount = tonumber(ARGV[2])
local force = ARGV[3] == '1'
local rate = per_minute / 60.0
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local held = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(held[1]) or per_minute
local at = tonumber(held[2]) or now
tokens = math.min(per_minute, tokens + math.max(0, now - at) * rate)
local retry = '0'
if force or amount <= tokens then
  tokens = math.min(per_minute, tokens - amount)
elseif amount > per_minute then
  retry = 'inf'
else
  retry = tostring((amount - tokens) / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((per_minute - tokens) / rate * 1000) + 1000)
return {tostring(tokens), retry}
"""


# KEYS[1]: a tenant's seats (a sorted set of tickets, each scored with when it lapses);
# ARGV: the limit, the ticket, how long a seat may be held (s). A seat whose request's
# replica died lapses after that: the longest answer the app allows.
_ENTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3])) + 1)
return 1
"""


class RedisBuckets:
    """Buckets in a Redis, shared by every ingress replica (see the module's docstring).

    ``fail_open``: whether a request is let in when the Redis cannot be reached;
    ``seat_s``: how long a request's seat among its tenant's at once may be held (the
    longest answer), after which it lapses if its replica died holding it."""

    def __init__(self, url: str, key_prefix: str, fail_open: bool = True, seat_s: float = 600):
        # Imported here: an app on the memory store never needs the client.
        import redis.asyncio

        self._redis = redis.asyncio.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self._script = self._redis.register_script(_TAKE)
        self._enter = self._redis.register_script(_ENTER)
        self._seat_s = seat_s
        self._unreachable = (redis.ConnectionError, redis.TimeoutError)
        self.key_prefix, self.fail_open = key_prefix, fail_open
        self._complained_at = float("-inf")
        self.reachable = True  # as the last call found it (GET /health says it)

    async def take(
        self, name: str, per_minute: int, amount: int = 1, kind: str = "requests"
    ) -> Quota:
        try:
            tokens, retry = await self._call(name, per_minute, amount, force=False)
        except self._unreachable as error:
            return self._unlimited(kind, per_minute, error)
        return _quota(kind, float(tokens), per_minute, float(retry))

    async def settle(self, name: str, per_minute: int, amount: int) -> None:
        try:
            await self._call(name, per_minute, amount, force=True)
        except self._unreachable as error:  # what it would settle is lost: say so
            log.warning(
                "rate limits (Redis) unreachable: %s's %+d not settled: %s", name, amount, error
            )

    async def _call(self, name: str, per_minute: int, amount: int, force: bool):
        try:
            result = await self._script(
                keys=[self.key_prefix + name], args=[per_minute, amount, int(force)]
            )
        except self._unreachable:
            self.reachable = False
            raise
        self.reachable = True
        return result

    async def enter(self, name: str, limit: int) -> str | None:
        ticket = uuid.uuid4().hex
        try:
            entered = await self._enter(
                keys=[self.key_prefix + name], args=[limit, ticket, self._seat_s]
            )
        except self._unreachable as error:
            self.reachable = False
            self._unlimited("requests", limit, error)  # closed: raises
            return ticket
        self.reachable = True
        return ticket if entered else None

    async def leave(self, name: str, ticket: str) -> None:
        try:
            await self._redis.zrem(self.key_prefix + name, ticket)
        except self._unreachable as error:  # the seat lapses on its own
            log.warning(
                "rate limits (Redis) unreachable: a seat of %s not given back: %s", name, error
            )

    async def reachable_now(self) -> bool:
        """Whether the Redis answers a PING now (``GET /health``; a probe's own timeout
        is often 1 s, so this waits half of it at most)."""
        try:
            await asyncio.wait_for(self._redis.ping(), HEALTH_TIMEOUT_S)
        except (*self._unreachable, TimeoutError):
            self.reachable = False
        else:
            self.reachable = True
        return self.reachable

    async def close(self) -> None:
        await self._redis.aclose()

    def _unlimited(self, kind: str, per_minute: int, error: Exception) -> Quota:
        if time.monotonic() - self._complained_at > 60:
            self._complained_at = time.monotonic()
            what = "letting requests in" if self.fail_open else "refusing requests (503)"
            log.warning("rate limits (Redis) unreachable, %s: %s", what, error)
        if not self.fail_open:
            raise Overloaded("the rate limits' store is not available; retry")
        return Quota(kind, per_minute, per_minute, 0.0)


def duration(seconds: float) -> str:
    """OpenAI's form of a reset time in its headers: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


def quota_headers(quotas: list[Quota], anthropic: bool) -> list[tuple[bytes, bytes]]:
    """The headers every answer under a limit carries: OpenAI's ``x-ratelimit-*``, or
    Anthropic's ``anthropic-ratelimit-*`` (its reset an RFC 3339 time) on its API."""
    pairs = []
    for quota in quotas:
        if anthropic:
            reset = datetime.now(UTC) + timedelta(seconds=quota.reset_s)
            prefix = f"anthropic-ratelimit-{quota.kind}"
            pairs += [
                (f"{prefix}-limit", quota.limit),
                (f"{prefix}-remaining", quota.remaining),
                (f"{prefix}-reset", reset.strftime("%Y-%m-%dT%H:%M:%SZ")),
            ]
        else:
            pairs += [
                (f"x-ratelimit-limit-{quota.kind}", quota.limit),
                (f"x-ratelimit-remaining-{quota.kind}", quota.remaining),
                (f"x-ratelimit-reset-{quota.kind}", duration(quota.reset_s)),
            ]
    return [(name.encode(), str(value).encode()) for name, value in pairs]


# What runs after an answer, off its path (settlements, seats given back): held so that
# none is collected before it has run.
_after: set[asyncio.Task] = set()


def in_background(work: Awaitable[None]) -> None:
    task = asyncio.ensure_future(work)
    _after.add(task)
    task.add_done_callback(_after.discard)
