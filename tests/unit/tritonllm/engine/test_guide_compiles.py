"""The compile workers' rules, over a compiler whose compiles the test lets finish: one
compile per guide in flight, the limit counted from the compile's start, guides past it
refused at once until their compile ends, the wait for a busy worker bounded, an
abandoned compile dropped before it starts."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tritonllm.engine.guide_compiles import (
    CompilersBusy,
    GuideCompiles,
    GuideTooSlow,
    PendingGuide,
)

ROOT = Path(__file__).resolve().parents[4]


class GatedCompiler:
    """Compiles a guide when the test opens its gate (at once for guides not gated)."""

    def __init__(self):
        self.gates: dict[str, threading.Event] = {}
        self.compiled: list[str] = []

    def gate(self, guide: str) -> threading.Event:
        return self.gates.setdefault(guide, threading.Event())

    def compile(self, guide_type: str, guide: str) -> str:
        if guide in self.gates:
            assert self.gates[guide].wait(30)
        self.compiled.append(guide)
        return f"compiled {guide}"


def wait_ready(pending: PendingGuide, timeout_s: float = 10) -> float:
    started = time.monotonic()
    while not pending.ready(time.monotonic()):
        assert time.monotonic() - started < timeout_s, "never ready"
        time.sleep(0.01)
    return time.monotonic() - started


@pytest.fixture
def compiler():
    compiler = GatedCompiler()
    yield compiler
    for gate in compiler.gates.values():
        gate.set()


def test_requests_with_one_guide_share_its_compile(compiler):
    compiles = GuideCompiles(lambda: compiler, timeout_s=5)
    gate = compiler.gate("a")
    first, second = compiles.start("regex", "a"), compiles.start("regex", "a")
    gate.set()
    wait_ready(first), wait_ready(second)
    assert compiles.settle(first).grammar == compiles.settle(second).grammar == "compiled a"
    assert compiler.compiled == ["a"]


def test_the_limit_counts_from_the_compiles_start_not_the_compilers_setup(compiler):
    def slow_setup():
        time.sleep(0.5)  # XGrammar's import and the vocabulary, once per engine
        return compiler

    compiles = GuideCompiles(slow_setup, timeout_s=0.3)
    pending = compiles.start("regex", "quick")
    wait_ready(pending)
    assert compiles.settle(pending).grammar == "compiled quick"


def test_a_compile_past_the_limit_is_refused_and_then_at_once_until_it_ends(compiler):
    compiles = GuideCompiles(lambda: compiler, timeout_s=0.2)
    gate = compiler.gate("slow")
    pending = compiles.start("regex", "slow")
    wait_ready(pending)
    # The limit runs from the compile's start, which the worker may make before this
    # test begins to wait.
    assert 0.2 <= time.monotonic() - pending.compile.started < 1
    with pytest.raises(GuideTooSlow, match="exceeds the limit of 0.2 s"):
        compiles.settle(pending)
    with pytest.raises(GuideTooSlow):
        compiles.start("regex", "slow")  # its compile runs on
    gate.set()
    deadline = time.monotonic() + 10
    while compiler.compiled != ["slow"] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # its end is recorded after the compile returns
    again = compiles.start("regex", "slow")  # compiled now: served (from the cache)
    wait_ready(again)
    assert compiles.settle(again).grammar == "compiled slow"


def test_waiting_too_long_for_a_busy_worker_is_a_retry(compiler):
    compiles = GuideCompiles(lambda: compiler, timeout_s=5, workers=1, wait_limit_s=0.2)
    compiler.gate("busy")
    compiles.start("regex", "busy")
    waiting = compiles.start("regex", "next")
    assert wait_ready(waiting) >= 0.2
    with pytest.raises(CompilersBusy, match="retry"):
        compiles.settle(waiting)


def test_an_abandoned_compile_that_has_not_started_is_dropped(compiler):
    compiles = GuideCompiles(lambda: compiler, timeout_s=5, workers=1)
    gate = compiler.gate("busy")
    compiles.start("regex", "busy")
    queued = compiles.start("regex", "queued")
    compiles.abandon(queued)
    gate.set()
    time.sleep(0.3)
    assert compiler.compiled == ["busy"] and queued.compile.future.cancelled()


def test_a_process_exits_while_a_compile_runs_on():
    """A compile that never ends (a runaway guide) does not hold its process at exit, as a
    Python-backend stub exits when Triton unloads its model."""
    script = (
        "import threading\n"
        "from tritonllm.engine.guide_compiles import GuideCompiles\n"
        "class Endless:\n"
        "    def compile(self, guide_type, guide):\n"
        "        threading.Event().wait()\n"
        "compiles = GuideCompiles(Endless, timeout_s=1)\n"
        "compiles.start('regex', 'a{0,50}')\n"
        "compiles.shutdown()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30, cwd=ROOT)
