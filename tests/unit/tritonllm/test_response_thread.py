"""The response thread: ordered delivery, cancellation polling, failures cancel."""

from __future__ import annotations

import threading
import time

import pytest

from tritonllm.response_thread import ResponseThread


class FakeSink:
    def __init__(self, fail_on=None):
        self.cancelled = False
        self.delivered = []
        self.polls = 0
        self.client_gone = False
        self.fail_on = fail_on
        self.final = threading.Event()

    def deliver(self, item):
        if item == self.fail_on:
            raise RuntimeError("sender closed")
        self.delivered.append(item)
        if item == "final":
            self.final.set()
            return True
        return False

    def poll_cancelled(self):
        self.polls += 1
        return self.client_gone


def join_lists(earlier, later):  # lists of tokens join; "final" ends a request
    return None if "final" in (earlier, later) else earlier + later


def wait_until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_items_arrive_in_order_and_the_final_one_ends_polling():
    thread = ResponseThread(poll_interval_s=0.001)
    sink = FakeSink()
    thread.watch(sink)
    for item in [1, 2, 3, "final"]:
        thread.send(sink, item)
    assert sink.final.wait(5)
    assert sink.delivered == [1, 2, 3, "final"]
    polls = sink.polls
    time.sleep(0.05)
    assert sink.polls == polls  # no longer watched
    thread.close()


def test_a_disconnected_client_is_flagged_for_the_engine():
    thread = ResponseThread(poll_interval_s=0.001)
    sink = FakeSink()
    thread.watch(sink)
    sink.client_gone = True
    wait_until(lambda: sink.cancelled)
    thread.close()


def test_a_failing_send_cancels_only_its_request():
    thread = ResponseThread(poll_interval_s=0.001)
    broken, good = FakeSink(fail_on=2), FakeSink()
    for sink in (broken, good):
        thread.watch(sink)
        thread.send(sink, 1)
        thread.send(sink, 2)
        thread.send(sink, "final")
    assert good.final.wait(5)
    assert good.delivered == [1, 2, "final"] and not good.cancelled
    assert broken.cancelled and broken.delivered[0] == 1
    thread.close()


def test_close_delivers_what_is_queued():
    thread = ResponseThread(poll_interval_s=1.0)
    sink = FakeSink()
    for item in range(100):
        thread.send(sink, item)
    thread.close()
    assert sink.delivered == list(range(100))


def test_items_queued_while_the_thread_is_busy_go_out_merged_per_request():
    """A request's items that queue behind a slow round trip leave as one response;
    items of other requests never join them, and each request keeps its order."""
    release = threading.Event()

    class SlowSink(FakeSink):
        def deliver(self, item):
            release.wait(5)
            return super().deliver(item)

    thread = ResponseThread(poll_interval_s=1.0, merge=join_lists)
    slow, a, b = SlowSink(), FakeSink(), FakeSink()
    thread.send(slow, [0])  # the thread is held in this round trip
    for i in range(1, 4):
        thread.send(a, [i])
        thread.send(b, [10 * i])
    thread.send(a, "final")
    release.set()
    assert a.final.wait(5)
    thread.close()
    assert a.delivered == [[1, 2, 3], "final"]
    assert b.delivered == [[10, 20, 30]]


def test_chunks_merge_as_one_streamed_response():
    from tritonllm.engine.scheduler import GenerationChunk, merge_chunks

    def chunk(tokens, outputs, finished=False, reason=None):
        return GenerationChunk(tokens, [-0.5] * len(tokens), -0.5 * outputs, 3, outputs,
                               finished, reason)  # fmt: skip

    first, second, last = chunk([7], 1), chunk([8, 9], 3), chunk([4], 4, True, "length")
    assert merge_chunks(merge_chunks(first, second), last) == GenerationChunk(
        [7, 8, 9, 4], [-0.5] * 4, -2.0, 3, 4, True, "length"
    )
    assert merge_chunks(last, first) is None  # nothing follows a final response
    assert merge_chunks(first, "an error") is None


class TimedSink(FakeSink):
    """A sink that notes when each item was delivered."""

    def __init__(self):
        super().__init__()
        self.times = []

    def deliver(self, item):
        self.times.append(time.monotonic())
        return super().deliver(item)


def budgeted(chunks_per_s: float) -> ResponseThread:
    return ResponseThread(
        poll_interval_s=1.0,
        merge=join_lists,
        chunks_per_s=chunks_per_s,
        is_final=lambda item: item == "final",
    )


def test_under_a_budget_a_requests_items_wait_for_their_turn_and_leave_joined():
    """One request in flight at 5 responses a second: its items leave at most every
    0.2 s, each with what came meanwhile; the first does not wait, nor does the last."""
    thread = budgeted(5)
    sink = TimedSink()
    thread.watch(sink)
    thread.send(sink, [1])
    wait_until(lambda: sink.delivered == [[1]])
    thread.send(sink, [2])
    thread.send(sink, [3])
    time.sleep(0.05)
    thread.send(sink, [4])
    wait_until(lambda: len(sink.delivered) == 2)
    assert sink.delivered == [[1], [2, 3, 4]]
    assert sink.times[1] - sink.times[0] >= 0.19
    thread.send(sink, [5])  # held: its turn is 0.2 s away ...
    thread.send(sink, "final")  # ... but the last item goes at once, after it
    assert sink.final.wait(0.15)
    assert sink.delivered == [[1], [2, 3, 4], [5], "final"]
    thread.close()


def test_the_interval_is_the_requests_in_flight_over_the_budget():
    """At 100 responses a second, 20 requests in flight wait 0.2 s between responses;
    once the others have ended, the one left waits 0.01 s."""
    thread = budgeted(100)
    others = [FakeSink() for _ in range(19)]
    sink = TimedSink()
    for each in [sink, *others]:
        thread.watch(each)
    for step in range(3):
        thread.send(sink, [step])
        time.sleep(0.02)
    wait_until(lambda: len(sink.delivered) == 2)
    assert sink.delivered == [[0], [1, 2]] and sink.times[1] - sink.times[0] >= 0.19
    for other in others:
        thread.send(other, "final")
    wait_until(lambda: all(other.final.is_set() for other in others))
    start = time.monotonic()
    for step in range(3, 6):
        thread.send(sink, [step])
        time.sleep(0.02)
    wait_until(lambda: sum(len(item) for item in sink.delivered) == 6)
    assert time.monotonic() - start < 0.2  # no longer 0.2 s a response
    thread.close()


def test_close_delivers_what_the_budget_holds():
    thread = budgeted(1)
    sink = FakeSink()
    thread.watch(sink)
    thread.send(sink, [1])
    wait_until(lambda: sink.delivered == [[1]])
    thread.send(sink, [2])  # its turn is 1 s away
    thread.close()
    assert sink.delivered == [[1], [2]]


def test_a_budget_needs_a_merge_and_a_final_test():
    for kwargs in ({}, {"merge": join_lists}, {"is_final": bool}):
        with pytest.raises(ValueError, match="merge and is_final"):
            ResponseThread(chunks_per_s=10, **kwargs)
    with pytest.raises(ValueError, match="0 \\(no budget\\) or more"):
        ResponseThread(chunks_per_s=-1, merge=join_lists, is_final=bool)
