"""Guides compiled off the engine's serving path, each within a time limit.

XGrammar's compile (the token masks of a guide's grammar over the model's vocabulary)
takes time that grows with the grammar, not with the request: a regex of many bounded
repetitions, or a JSON Schema ``pattern`` holding one, takes seconds to minutes. Done in
Triton's ``execute`` call or in the step loop, it would hold every other request of the
model. Here it runs on a worker thread (XGrammar releases the GIL while it compiles) at
the lowest CPU priority, while its request waits in the engine's queue and the running
batch keeps stepping (vLLM's ``WAITING_FOR_FSM``).

A compile still running at its request's deadline fails that request (the guide is
refused as too slow to serve). XGrammar cannot stop a compile, and a compile cannot move
to a process that could be killed (a compiled regex grammar serializes to hundreds of
MB), so the thread runs on at that priority (a daemon: the process exits without waiting
for it); the guide is remembered meanwhile, and sent again it is refused at once. Once
such a compile ends, its grammar is in XGrammar's cache and the guide is served from there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tritonllm.guided import GuideCompiler, InvalidGuide

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
# Compiles at once. Each runs at the lowest priority, so they share what the engine leaves
# of the CPU; a compile past its limit holds its thread until it ends, so it takes this
# many such compiles at once before a new guide waits for a thread.
DEFAULT_WORKERS = 4
# How long a request may wait for a free worker (at least; 6 compile limits if longer).
DEFAULT_WAIT_LIMIT_S = 30.0
_SLOW_GUIDES = 1024  # guides remembered as too slow while their compile runs on


class GuideTooSlow(InvalidGuide):
    """The guide's compile passed the time limit: the request is refused (a 400)."""


class CompilersBusy(RuntimeError):
    """Every compile worker stayed busy with other guides: the request may retry (503)."""


@dataclass(frozen=True)
class Compiled:
    grammar: xgrammar.CompiledGrammar
    seconds: float  # how long its compile took on the worker


@dataclass
class _Compile:
    """One guide's compile, shared by the requests that wait for it."""

    future: Future | None = None  # set as it is submitted
    started: float | None = None  # time.monotonic() when a worker began compiling it


@dataclass
class PendingGuide:
    """One request's guide on its way: ready once compiled or failed, once its compile has
    run past the limit, or once it has waited too long for a worker."""

    guide_type: str
    key: bytes
    compile: _Compile
    limit_s: float  # on the compile, from when a worker starts it
    wait_limit_s: float  # on the wait for a worker
    arrived: float = field(default_factory=time.monotonic)

    def ready(self, now: float) -> bool:
        started = self.compile.started
        if self.compile.future.done():
            return True
        if started is None:
            return now - self.arrived >= self.wait_limit_s
        return now - started >= self.limit_s


class GuideCompiles:
    """Compiles on ``workers`` threads, one per distinct guide in flight; a request waits
    for its guide's compile at most ``timeout_s`` once a worker has started it (the
    compiler's own setup, XGrammar's import and the tokenizer's vocabulary, excluded), and
    at most ``wait_limit_s`` for a worker. ``on_ready`` is called (on the worker) when a
    compile ends, so that the engine's loop wakes."""

    def __init__(
        self,
        compiler: Callable[[], GuideCompiler],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = DEFAULT_WORKERS,
        on_ready: Callable[[], None] = lambda: None,
        wait_limit_s: float | None = None,
    ):
        self._compiler = compiler  # made on first use, on a worker (XGrammar's import)
        self.timeout_s = timeout_s
        self.wait_limit_s = wait_limit_s or max(DEFAULT_WAIT_LIMIT_S, 6 * timeout_s)
        self._on_ready = on_ready
        self._pool = DaemonWorkers(workers, "guide-compile", initializer=_lowest_priority)
        # Reentrant: a future that is already done runs its callback (which takes the
        # lock) in the thread that adds it or cancels it.
        self._lock = threading.RLock()
        self._in_flight: dict[bytes, _Compile] = {}
        self._waiting: Counter[bytes] = Counter()  # requests waiting for each compile
        self._too_slow: OrderedDict[bytes, None] = OrderedDict()

    def start(self, guide_type: str, guide: str) -> PendingGuide:
        """The guide's compile, started or joined; raises :class:`GuideTooSlow` at once
        for a guide whose compile passed the limit and still runs."""
        key = hashlib.sha256(f"{guide_type}\0{guide}".encode()).digest()
        with self._lock:
            if key in self._too_slow:
                raise GuideTooSlow(self._too_slow_message(guide_type))
            compile = self._in_flight.get(key)
            if compile is None:
                compile = _Compile()
                compile.future = self._pool.submit(self._compile, guide_type, guide, compile)
                self._in_flight[key] = compile
                compile.future.add_done_callback(lambda _: self._ended(key))
            self._waiting[key] += 1
        return PendingGuide(guide_type, key, compile, self.timeout_s, self.wait_limit_s)

    def settle(self, pending: PendingGuide) -> Compiled:
        """A ready guide's compiled grammar; :class:`InvalidGuide` for a guide XGrammar
        refused, :class:`GuideTooSlow` past the limit (the guide is then refused until its
        compile ends), :class:`CompilersBusy` after the longest wait for a worker."""
        self._release(pending)
        if pending.compile.future.done():
            return pending.compile.future.result()
        if pending.compile.started is None:
            raise CompilersBusy(
                f"no guide compiler was free within {self.wait_limit_s:g} s (all of them are "
                "compiling other guides): the server is unavailable for new guides; retry later"
            )
        with self._lock:
            self._too_slow[pending.key] = None
            while len(self._too_slow) > _SLOW_GUIDES:
                self._too_slow.popitem(last=False)
        log.warning(
            "a %s guide passed the compile limit of %g s", pending.guide_type, self.timeout_s
        )
        raise GuideTooSlow(self._too_slow_message(pending.guide_type))

    def abandon(self, pending: PendingGuide) -> None:
        """Its request left: a compile no other request waits for is dropped if it has
        not started (a running compile cannot be stopped)."""
        if self._release(pending) == 0:
            pending.compile.future.cancel()

    def shutdown(self) -> None:
        self._pool.shutdown()

    def _release(self, pending: PendingGuide) -> int:
        with self._lock:
            self._waiting[pending.key] -= 1
            left = self._waiting[pending.key]
            if left <= 0:
                del self._waiting[pending.key]
            return left

    def _too_slow_message(self, guide_type: str) -> str:
        return (
            f"compiling this {guide_type} guide exceeds the limit of {self.timeout_s:g} s "
            "(guide_compile_timeout_s): send a smaller or simpler guide (fewer or shorter "
            "bounded repetitions, a shallower schema)"
        )

    def _compile(self, guide_type: str, guide: str, compile: _Compile) -> Compiled:
        compiler = self._compiler()
        compile.started = time.monotonic()
        started = time.perf_counter()
        grammar = compiler.compile(guide_type, guide)
        return Compiled(grammar, time.perf_counter() - started)

    def _ended(self, key: bytes) -> None:
        with self._lock:
            self._in_flight.pop(key, None)
            self._too_slow.pop(key, None)  # compiled now: XGrammar's cache serves it
        self._on_ready()


class DaemonWorkers:
    """``workers`` daemon threads that run submitted calls into futures, started with the
    first call (an engine that is never sent a guide starts none).

    Not ``concurrent.futures.ThreadPoolExecutor``: the interpreter joins its threads at
    exit, so a process holding a runaway compile (Triton's Python-backend stub, on unload
    or shutdown) would not end until the compile did, minutes for a hostile guide. A
    daemon thread ends with its process."""

    def __init__(self, workers: int, name: str, initializer: Callable[[], None]):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        self._name, self._initializer = name, initializer
        self._started = threading.Lock()
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable, *args) -> Future:
        future = Future()
        self._calls.put((future, fn, args))
        with self._started:
            while len(self._threads) < self._workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        return future

    def shutdown(self) -> None:
        """Calls not started are cancelled; running ones end on their own."""
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        for _ in self._threads:
            self._calls.put(None)

    def _work(self) -> None:
        self._initializer()
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # the future carries it to its request
                future.set_exception(error)


def _lowest_priority() -> None:
    """A compile's thread (and the threads XGrammar starts from it, which inherit its
    priority) yields the CPU to the engine, Triton and the tokenizers."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: per thread
    except (AttributeError, OSError):  # not Linux, or not allowed: normal priority
        pass
