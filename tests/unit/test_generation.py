"""coalesce(): what a hop sends when it keeps up, when it falls behind, and on the way out."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve.generation import GenerationChunk, coalesce


def chunk(i: int, reason: str | None = None) -> GenerationChunk:
    return GenerationChunk(f" w{i}", 7, i + 1, cum_log_prob=-float(i), finish_reason=reason)


async def source(count: int, gap_s: float = 0.0, fail: bool = False, closed: list | None = None):
    try:
        for i in range(count):
            if gap_s:
                await asyncio.sleep(gap_s)
            yield chunk(i, "length" if i == count - 1 else None)
        if fail:
            raise RuntimeError("the engine failed")
    finally:
        if closed is not None:
            closed.append(True)


async def collect(chunks, consumer_delay_s: float = 0.0) -> list[GenerationChunk]:
    got = []
    async for c in chunks:
        got.append(c)
        if consumer_delay_s:
            await asyncio.sleep(consumer_delay_s)
    return got


def test_a_consumer_that_keeps_up_gets_every_chunk_alone():
    got = asyncio.run(collect(coalesce(source(5, gap_s=0.005))))
    assert got == [chunk(i, "length" if i == 4 else None) for i in range(5)]


def test_chunks_that_arrive_while_the_consumer_is_busy_go_out_merged():
    got = asyncio.run(collect(coalesce(source(20, gap_s=0.001)), consumer_delay_s=0.02))
    assert 1 < len(got) < 20
    assert "".join(c.text for c in got) == "".join(f" w{i}" for i in range(20))
    last = got[-1]
    assert (last.num_output_tokens, last.cum_log_prob, last.finish_reason) == (20, -19.0, "length")
    assert all(c.finish_reason is None for c in got[:-1])


def test_a_stream_interval_spaces_the_chunks_but_never_delays_the_first():
    async def timed():
        start, stamps = time.monotonic(), []
        async for c in coalesce(source(30, gap_s=0.002), interval_s=0.02):
            stamps.append((time.monotonic() - start, c))
        return stamps

    stamps = asyncio.run(timed())
    times = [t for t, _ in stamps]
    assert times[0] < 0.015 and stamps[0][1] == chunk(0)
    gaps = [b - a for a, b in zip(times, times[1:-1], strict=False)]
    assert gaps and min(gaps) >= 0.018  # the last may leave early: the source ended
    assert "".join(c.text for _, c in stamps) == "".join(f" w{i}" for i in range(30))


def test_an_error_comes_after_the_chunks_sent_before_it():
    got = []

    async def run():
        async for c in coalesce(source(3, fail=True)):
            got.append(c)

    with pytest.raises(RuntimeError, match="engine failed"):
        asyncio.run(run())
    assert "".join(c.text for c in got) == " w0 w1 w2"


def test_closing_early_closes_the_source():
    closed: list = []

    async def run():
        stream = coalesce(source(1000, gap_s=0.001, closed=closed))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(run())
    assert closed == [True]
