"""Sending responses and polling cancellation off the engine's thread.

In Triton's Python backend every ``response_sender.send`` and every
``request.is_cancelled()`` is a synchronous round trip from the model's stub
process to the server. Done on the engine thread, they stalled each decode step by
both round trips per running sequence, a large share of a CPU engine's step at 16
sequences. One thread here does both while the engine computes; the engine only
reads a flag.

Each round trip costs the same whatever a response carries, so the thread sends
what is ready: it takes everything queued at once and, given a ``merge``, joins a
request's consecutive items into one response (the tokens of several engine steps
when the thread fell behind; one token per response while it keeps up, so nothing
ever waits for a batch).

Under load a model's streams also share a budget of ``chunks_per_s`` responses a
second: each request's responses leave at most every (requests in flight /
``chunks_per_s``) seconds, each holding everything made meanwhile; the first and the
last never wait. Every hop after the engine (Triton's core, the postprocessing or the
Triton replica, the HTTP front, the client) pays per response, so at GPU token rates
this is what keeps their cost per token low (the replica paces its own output the same
way, ``serve.generation.StreamPacing``, for engines that do not). At 16 requests and
1,000 a second the interval is 16 ms, shorter than a CPU engine's step: nothing waits.

Nothing here imports pb_utils: a sink gives ``deliver(item)`` (the round trip)
and ``poll_cancelled()`` (the check).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

_STOP = object()
# At most this many queued items are taken per round (a bound on one round's latency).
_MAX_ROUND = 4096

# merge(earlier, later): one item standing for both, or None where they cannot join.
Merge = Callable[[Any, Any], Any]


class Deliverable(Protocol):
    cancelled: bool

    def deliver(self, item) -> bool:
        """Send ``item``; True when it was the request's final response."""

    def poll_cancelled(self) -> bool: ...


class ResponseThread:
    def __init__(
        self,
        poll_interval_s: float = 0.01,
        merge: Merge | None = None,
        chunks_per_s: float = 0.0,
        is_final: Callable[[Any], bool] | None = None,
    ):
        """``chunks_per_s``: the shared budget (0: none), which needs ``merge`` to join
        a request's held items and ``is_final`` to tell the last one (it never waits)."""
        if chunks_per_s < 0:
            raise ValueError(f"chunks_per_s must be 0 (no budget) or more, not {chunks_per_s}")
        if chunks_per_s and (merge is None or is_final is None):
            raise ValueError("a chunk budget needs merge and is_final")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._merge = merge
        self._chunks_per_s = chunks_per_s
        self._is_final = is_final
        self._held: dict[int, list] = {}  # id(sink) -> [sink, item] waiting for its turn
        self._last_sent: dict[int, float] = {}  # id(sink) -> when its last item left
        self._watched: dict[int, Deliverable] = {}
        self._lock = threading.Lock()
        self._poll_interval_s = poll_interval_s
        self._thread = threading.Thread(target=self._run, name="response-thread", daemon=True)
        self._thread.start()

    def watch(self, sink: Deliverable) -> None:
        """Poll ``sink`` for cancellation until its final response is delivered."""
        with self._lock:
            self._watched[id(sink)] = sink

    def unwatch(self, sink: Deliverable) -> None:
        with self._lock:
            self._watched.pop(id(sink), None)

    def send(self, sink: Deliverable, item) -> None:
        """Queue ``item`` for ``sink``; items are delivered in the order they were sent."""
        self._queue.put((sink, item))

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued, then stop."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        next_poll = time.monotonic()
        next_due = math.inf  # when the first held item's turn comes
        while True:
            wake = min(next_poll, next_due)
            try:
                entry = self._queue.get(timeout=max(0.0, wake - time.monotonic()))
            except queue.Empty:
                entry = None
            if entry is not None:
                entries = self._take_ready(entry)
                stopping = entries[-1] is _STOP
                for sink, item in self._joined(entries[:-1] if stopping else entries):
                    self._pace(sink, item)
                if stopping:
                    for sink, item in list(self._held.values()):
                        self._deliver(sink, item)
                    return
            next_due = self._deliver_due()
            if time.monotonic() >= next_poll:
                self._poll()
                next_poll = time.monotonic() + self._poll_interval_s

    def _take_ready(self, first) -> list:
        """``first`` and whatever else is queued now (up to ``_STOP``)."""
        entries = [first]
        while first is not _STOP and len(entries) < _MAX_ROUND:
            try:
                entries.append(self._queue.get_nowait())
            except queue.Empty:
                break
            if entries[-1] is _STOP:
                break
        return entries

    def _joined(self, entries: list) -> list:
        """``(sink, item)`` pairs, each sink's consecutive items merged where ``merge``
        allows; each sink's items stay in order."""
        if self._merge is None:
            return entries
        joined: list[list] = []
        last: dict[int, list] = {}  # id(sink) -> its latest entry in ``joined``
        for sink, item in entries:
            previous = last.get(id(sink))
            merged = None if previous is None else self._merge(previous[1], item)
            if merged is None:
                last[id(sink)] = [sink, item]
                joined.append(last[id(sink)])
            else:
                previous[1] = merged
        return joined

    def _interval_s(self) -> float:
        """How long a request's items wait after its last one left (0: no budget)."""
        return len(self._watched) / self._chunks_per_s if self._chunks_per_s else 0.0

    def _pace(self, sink: Deliverable, item) -> None:
        """Deliver ``item`` now, or hold it, joined to what ``sink`` holds, until its turn."""
        if not self._chunks_per_s:
            self._deliver(sink, item)
            return
        held = self._held.pop(id(sink), None)
        if held is not None:
            merged = self._merge(held[1], item)
            if merged is None:  # they cannot join: what was held goes first
                self._deliver(sink, held[1])
            else:
                item = merged
        last = self._last_sent.get(id(sink))
        if last is None or self._is_final(item) or time.monotonic() >= last + self._interval_s():
            self._deliver(sink, item)
        else:
            self._held[id(sink)] = [sink, item]

    def _deliver_due(self) -> float:
        """Deliver the held items whose turn has come; when the next turn comes.
        ``_last_sent`` is ordered by time sent (``_deliver`` moves a request to its end)
        and every request waits the same interval, so the scan stops at the first held
        item not yet due instead of reading all of them at each wake."""
        if not self._held:
            return math.inf
        now, interval = time.monotonic(), self._interval_s()
        due, next_due = [], math.inf
        for key, sent in self._last_sent.items():
            if key in self._held:
                if sent + interval > now:
                    next_due = sent + interval
                    break
                due.append(key)
        for key in due:
            self._deliver(*self._held.pop(key))
        return next_due

    def _deliver(self, sink: Deliverable, item) -> None:
        if self._chunks_per_s:  # moved to the end: the order _deliver_due reads
            self._last_sent.pop(id(sink), None)
            self._last_sent[id(sink)] = time.monotonic()
        try:
            final = sink.deliver(item)
        except Exception:  # the client is gone: the engine drops the request next step
            log.exception("could not send a response; cancelling its request")
            sink.cancelled = final = True
        if final:
            self.unwatch(sink)
            self._last_sent.pop(id(sink), None)

    def _poll(self) -> None:
        with self._lock:
            sinks = list(self._watched.values())
        for sink in sinks:
            if sink.cancelled:
                continue
            try:
                sink.cancelled = sink.poll_cancelled()
            except Exception:
                sink.cancelled = True
