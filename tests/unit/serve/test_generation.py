"""coalesce(): what a hop sends when it keeps up, when it falls behind, and on the way out."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from serve.engines.triton.requests import chunk_from_outputs
from serve.generation import (
    GenerateParams,
    GenerationChunk,
    StreamPacing,
    TopLogProbs,
    coalesce,
)


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


async def timed(chunks) -> list[tuple[float, GenerationChunk]]:
    start, stamps = time.monotonic(), []
    async for c in chunks:
        stamps.append((time.monotonic() - start, c))
    return stamps


def gaps_between(stamps) -> list[float]:
    """The gaps between chunks, but the last (it leaves early: the source ended)."""
    times = [t for t, _ in stamps]
    return [b - a for a, b in zip(times, times[1:-1], strict=False)]


def test_a_stream_interval_spaces_the_chunks_but_never_delays_the_first():
    stamps = asyncio.run(timed(coalesce(source(30, gap_s=0.002), StreamPacing(interval_ms=20))))
    assert stamps[0][0] < 0.015 and stamps[0][1] == chunk(0)
    gaps = gaps_between(stamps)
    assert gaps and min(gaps) >= 0.018
    assert "".join(c.text for _, c in stamps) == "".join(f" w{i}" for i in range(30))


def test_streams_share_the_replicas_chunk_rate():
    """Three streams over 100 chunks a second: each sends every 30 ms, all of its text."""
    pacing = StreamPacing(chunks_per_s=100)

    async def three():
        return await asyncio.gather(
            *(timed(coalesce(source(40, gap_s=0.002), pacing)) for _ in range(3))
        )

    for stamps in asyncio.run(three()):
        assert stamps[0][0] < 0.015
        gaps = gaps_between(stamps)
        assert gaps and min(gaps) >= 0.028
        assert "".join(c.text for _, c in stamps) == "".join(f" w{i}" for i in range(40))
    assert pacing.live == 0  # every stream counted out, as it ended


def test_a_stream_slower_than_its_share_sends_each_chunk_alone():
    """One stream, 1,000 chunks a second: tokens 10 ms apart never wait or merge."""
    pacing = StreamPacing(chunks_per_s=1000)
    got = asyncio.run(collect(coalesce(source(5, gap_s=0.01), pacing)))
    assert got == [chunk(i, "length" if i == 4 else None) for i in range(5)]


def test_a_closed_stream_leaves_the_live_count():
    pacing = StreamPacing(chunks_per_s=1000)

    async def abandon():
        stream = coalesce(source(50, gap_s=0.001), pacing)
        await anext(stream)
        assert pacing.live == 1
        await stream.aclose()

    asyncio.run(abandon())
    assert pacing.live == 0


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


def test_a_chunk_from_ensemble_outputs_carries_alternatives_prompt_and_cache_count():
    params = GenerateParams("p", 4, return_log_probs=True, top_log_probs=2, prompt_log_probs=True)
    first = {
        "text_output": np.array([[b" a"]], dtype=object),
        "num_input_tokens": np.array([[3]], dtype=np.int32),
        "num_output_tokens": np.array([[1]], dtype=np.int32),
        "num_cached_tokens": np.array([[2]], dtype=np.int32),
        "output_ids": np.array([[[7]]], dtype=np.int32),
        "output_log_probs": np.array([[[-0.5]]], dtype=np.float32),
        "top_token_ids": np.array([[[7, 8]]], dtype=np.int32),
        "top_log_probs": np.array([[[-0.5, -1.5]]], dtype=np.float32),
        "prompt_token_ids": np.array([[1, 2, 3]], dtype=np.int32),
        "prompt_log_probs": np.array([[0.0, -1.0, -2.0]], dtype=np.float32),
        "prompt_top_token_ids": np.array([[[0, 0], [2, 4], [3, 5]]], dtype=np.int32),
        "prompt_top_log_probs": np.array([[[0, 0], [-1, -3], [-2, -4]]], dtype=np.float32),
    }
    chunk = chunk_from_outputs(first, params)
    assert chunk.top_log_probs == (TopLogProbs((7, 8), (-0.5, -1.5)),)
    assert chunk.prompt.token_ids == (1, 2, 3) and chunk.prompt.log_probs == (None, -1.0, -2.0)
    assert chunk.prompt.top_log_probs[0] is None
    assert chunk.prompt.top_log_probs[2] == TopLogProbs((3, 5), (-2.0, -4.0))
    # The final response of an EOS: no tokens; what only the first said is kept.
    final = {
        "text_output": np.array([[b""]], dtype=object),
        "num_input_tokens": np.array([[3]], dtype=np.int32),
        "num_output_tokens": np.array([[2]], dtype=np.int32),
        "output_ids": np.zeros((1, 1, 0), dtype=np.int32),
        "output_log_probs": np.zeros((1, 1, 0), dtype=np.float32),
        "top_token_ids": np.zeros((1, 0, 2), dtype=np.int32),
        "top_log_probs": np.zeros((1, 0, 2), dtype=np.float32),
    }
    last = chunk_from_outputs(final, params, chunk)
    assert last.top_log_probs == () and last.prompt is None and last.num_cached_tokens == 2
    assert chunk.merged(last).prompt == chunk.prompt
