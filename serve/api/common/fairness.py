"""Fair shares of a model's engines between tenants, held in each ingress replica.

Past capacity, Serve's routers and the engines' queues serve requests first come, first
served: a tenant that floods a model makes every other tenant's requests wait behind
its own. So each ingress replica holds a :class:`FairQueue` of *seats* per model, as
many as its share of the model's engines should run (``serve/app.py:fair_seats``: the
replicas' autoscaling target, times their most replicas, over the ingress replicas). A
request takes a seat before its first engine call and gives it back when its answer has
ended.

- A tenant holding less than its share of the seats (its weight's part of them, among
  the tenants holding or waiting) takes one at once, even past the seats: what it is
  owed never waits for another tenant's requests to end. At most the seats again are
  held past them, and only until the others' requests end.
- Past its share, a request waits while every seat is taken, and a freed seat goes to

  1. the most urgent priority waiting (vLLM's order: lower first; a tenant's own
     ``priority`` bounds how urgent its requests may be, serve/api/common/keyring.py), then
  2. within that priority, the tenants by deficit round robin over tokens (Shreedhar
     and Varghese's DRR, as Dynamo weighs its tenants): each tenant in turn gets a
     quantum of ``QUANTUM`` tokens times its ``weight`` and sends requests while they
     cost no more than it has, a request costing its prompt and its ``max_tokens``. The
     tenants waiting share the freed seats' tokens in proportion to their weights,
     whatever their requests' sizes or numbers;
  3. within a tenant and a priority, first come, first served.

- Past the model's ``max_queued_requests`` waiting, a request gets the 503 with
  ``Retry-After`` that Serve's own full queue gives.

Written here, not taken from a library: Serve's request routers choose a replica for a
request they already hold (they cannot keep one tenant's request behind another's),
and no maintained Python package does weighted DRR with priority bands over asyncio.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from serve.api.common.errors import Overloaded

# Tokens a tenant of weight 1 may send per turn: about one prompt and answer, so a
# turn is a request or two and tenants alternate closely.
QUANTUM = 1024


class QueueFull(Overloaded):
    """A model's fair queue holds ``max_waiting`` requests already: a 503 to retry, as
    Serve's own full queue is."""


def _future() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class _Waiter:
    tenant: str
    weight: float
    cost: int
    granted: asyncio.Future = field(default_factory=_future)  # its seat, when set


class _Band:
    """The waiters of one priority: a queue per tenant, served by deficit round robin."""

    def __init__(self) -> None:
        self.queues: OrderedDict[str, deque[_Waiter]] = OrderedDict()  # the round's order
        self.deficits: dict[str, float] = {}

    def push(self, waiter: _Waiter) -> None:
        if waiter.tenant not in self.queues:
            self.queues[waiter.tenant] = deque()
            self.deficits[waiter.tenant] = 0.0
        self.queues[waiter.tenant].append(waiter)

    def remove(self, waiter: _Waiter) -> None:
        queue = self.queues.get(waiter.tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                self._leave(waiter.tenant)

    def pop_next(self) -> _Waiter:
        """The next waiter by DRR: the tenant at the head of the round sends while its
        deficit covers its next request, then gets its quantum and goes to the back."""
        while True:
            tenant, queue = next(iter(self.queues.items()))
            head = queue[0]
            if self.deficits[tenant] >= head.cost:
                self.deficits[tenant] -= head.cost
                queue.popleft()
                if not queue:
                    self._leave(tenant)
                return head
            self.deficits[tenant] += QUANTUM * head.weight
            self.queues.move_to_end(tenant)

    def charge(self, tenant: str, cost: int) -> None:
        if tenant in self.deficits:
            self.deficits[tenant] -= cost

    def _leave(self, tenant: str) -> None:
        # DRR: a tenant with nothing waiting keeps no credit for when it comes back.
        del self.queues[tenant], self.deficits[tenant]


@dataclass
class _Account:
    """A tenant's seats held and requests waiting in one queue (kept while either is)."""

    weight: float
    held: int = 0
    waiting: int = 0


class FairQueue:
    """The seats of one model in this ingress replica (see the module's docstring)."""

    def __init__(
        self,
        seats: int,
        max_waiting: int = -1,
        on_wait: Callable[[str, float], None] | None = None,
    ):
        """``max_waiting``: requests past it get a 503 rather than wait (the model's
        ``max_queued_requests``, which Serve's queue, behind this one, would have held;
        -1: no bound); ``on_wait(tenant, seconds)``: each request's wait for its seat (0:
        at once)."""
        self.seats = seats
        self.taken = 0
        self.waiting = 0
        self._max_waiting = max_waiting
        self._bands: dict[int, _Band] = {}
        self._accounts: dict[str, _Account] = {}  # the tenants holding or waiting
        self._weights = 0.0  # theirs, together
        self._on_wait = on_wait or (lambda tenant, seconds: None)

    async def seat(self, tenant: str, weight: float, priority: int, cost: int) -> Seat:
        """A seat for a request of ``tenant`` costing ``cost`` tokens: at once while one
        is free and nobody waits, or while the tenant holds less than its share; else
        when its turn comes. A caller cancelled while waiting leaves the queue (a seat
        granted as it left is given back)."""
        account = self._account(tenant, weight)
        if (self.taken < self.seats and not self._bands) or self._under_share(account):
            self._take(account, 1)
            self._on_wait(tenant, 0.0)
            return Seat(self, tenant)
        if 0 <= self._max_waiting <= self.waiting:
            self._settle(tenant)
            raise QueueFull(
                f"the model's replicas are all busy and {self.waiting} requests wait; retry"
            )
        start = time.monotonic()
        waiter = _Waiter(tenant, weight, cost)
        self._bands.setdefault(priority, _Band()).push(waiter)
        account.waiting += 1
        self.waiting += 1
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._give_back(tenant, 1)
            else:
                self._forget(waiter, priority)
            raise
        self._on_wait(tenant, time.monotonic() - start)
        return Seat(self, tenant)

    def _under_share(self, account: _Account) -> bool:
        """Whether the tenant holds fewer seats than its weight's part of them, among
        the tenants holding or waiting: it may take one past the seats. So a tenant's
        share is there for it at once whatever others send (at most the seats again
        are held past them, and only until the others' requests end)."""
        return account.held < self.seats * account.weight / self._weights

    def _account(self, tenant: str, weight: float) -> _Account:
        account = self._accounts.get(tenant)
        if account is None:
            account = self._accounts[tenant] = _Account(weight)
            self._weights += weight
        return account

    def _take(self, account: _Account, count: int) -> None:
        account.held += count
        self.taken += count

    def _settle(self, tenant: str) -> None:
        account = self._accounts[tenant]
        if not account.held and not account.waiting:
            del self._accounts[tenant]
            self._weights -= account.weight

    def _forget(self, waiter: _Waiter, priority: int) -> None:
        band = self._bands.get(priority)
        if band is not None:
            band.remove(waiter)
            if not band.queues:
                del self._bands[priority]
        self._accounts[waiter.tenant].waiting -= 1
        self.waiting -= 1
        self._settle(waiter.tenant)

    def _widen(self, tenant: str, cost: int) -> None:
        self._take(self._accounts[tenant], 1)
        for band in self._bands.values():
            band.charge(tenant, cost)

    def _give_back(self, tenant: str, count: int) -> None:
        self._accounts[tenant].held -= count
        self.taken -= count
        self._settle(tenant)
        while self.taken < self.seats and self._bands:
            priority = min(self._bands)
            band = self._bands[priority]
            waiter = band.pop_next()
            if not band.queues:
                del self._bands[priority]
            if waiter.granted.done():  # cancelled: its task, leaving, forgets it
                continue
            account = self._accounts[waiter.tenant]
            account.waiting -= 1
            self.waiting -= 1
            self._take(account, 1)
            waiter.granted.set_result(None)


class Seat:
    """What one request holds of a :class:`FairQueue` until :meth:`give_back`. A request
    with several engine calls (a list of prompts, ``n`` choices) queues for its first;
    each further call takes one more seat at once (:meth:`widen`): it never waits
    holding a seat (which could deadlock a request with more prompts than seats) and the
    others wait until its calls end; its tenant's round pays their tokens."""

    def __init__(self, queue: FairQueue, tenant: str):
        self._queue, self._tenant = queue, tenant
        self._held = 1

    def widen(self, cost: int) -> None:
        if self._held:
            self._held += 1
            self._queue._widen(self._tenant, cost)

    def give_back(self) -> None:
        held, self._held = self._held, 0
        if held:
            self._queue._give_back(self._tenant, held)
