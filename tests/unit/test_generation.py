"""coalesce(): what a hop sends when it keeps up, when it falls behind, and on the way out."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from serve.generation import GenerateParams, GenerationChunk, TopLogProbs, coalesce
from serve.triton.requests import chunk_from_outputs


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
