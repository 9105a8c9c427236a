"""The response thread: ordered delivery, cancellation polling, failures cancel."""

from __future__ import annotations

import threading
import time

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

    def merge(earlier, later):  # lists of tokens join; "final" ends a request
        return None if "final" in (earlier, later) else earlier + later

    thread = ResponseThread(poll_interval_s=1.0, merge=merge)
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
