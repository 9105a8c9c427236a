"""Baseline (a) of ``make bench``: the plain Ray Serve deployment a user writes first.

One deployment, no Triton, no batching: a ``transformers`` text-generation pipeline
called once per request, one request at a time (``max_ongoing_requests: 1``; Serve
queues the rest), the way a first ``/generate`` endpoint is usually written. It answers
``POST .../v1/completions`` with ``stream: true`` in OpenAI's shape, one
server-sent event per generated token that adds text (a token streamer, so its time
to first token is measured like the stack's), and usage in the last event. ``GET .../``
answers 200 (the benchmark's readiness probe).

Serve config (``bench/serving.py`` writes it)::

    import_path: bench.baseline_app:build_app
    args: {checkpoint: /path/to/hf_model, num_threads: 2}
"""

import asyncio
import json
import os
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from transformers.generation.streamers import BaseStreamer

# Serve's documented shape for HTTP deployments (a module-level FastAPI app), as a
# user's first deployment would have it.
app = FastAPI()


class TokenQueue(BaseStreamer):
    """generate()'s streamer: each new token id onto an asyncio queue, then None.

    generate() calls ``put`` first with the prompt, then once per generated token,
    from the pipeline's thread; the queue belongs to the event loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._prompt_seen = False
        self._ended = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self._loop.call_soon_threadsafe(self.queue.put_nowait, value.reshape(-1).tolist())

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self._loop.call_soon_threadsafe(self.queue.put_nowait, None)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@serve.ingress(app)
class PipelineBaseline:
    def __init__(self, checkpoint: str, num_threads: int = 0):
        import torch
        from transformers import pipeline

        # Ray sets OMP_NUM_THREADS to the replica's num_cpus (1); the baseline gets the
        # whole machine, as generate() in `make bench-engine` does.
        torch.set_num_threads(num_threads or os.cpu_count() or 1)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.pipe = pipeline("text-generation", model=checkpoint, device=device)
        self.tokenizer = self.pipe.tokenizer
        self._lock = threading.Lock()  # one generation at a time, whatever Serve sends

    @app.get("/")
    async def ready(self):
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        body = await request.json()
        max_tokens = int(body.get("max_tokens") or 16)
        streamer = TokenQueue(asyncio.get_running_loop())
        generation = asyncio.create_task(
            asyncio.to_thread(self._generate, body["prompt"], max_tokens, body, streamer)
        )
        if not body.get("stream"):
            ids = await self._drain(streamer)
            await generation
            return JSONResponse({"choices": [{"index": 0, "text": self.tokenizer.decode(ids)}]})
        return StreamingResponse(
            self._events(body, streamer, generation), media_type="text/event-stream"
        )

    def _generate(self, prompt: str, max_tokens: int, body: dict, streamer) -> None:
        min_tokens = int(body.get("min_tokens") or 0)
        with self._lock:
            try:
                self._call_pipeline(prompt, max_tokens, min_tokens, streamer)
            finally:  # a failed generate() never calls end(): the reader must not hang
                streamer.end()

    def _call_pipeline(self, prompt: str, max_tokens: int, min_tokens: int, streamer) -> None:
        self.pipe(
            prompt,
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens,
            do_sample=False,
            streamer=streamer,
            return_full_text=False,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    async def _drain(self, streamer: TokenQueue) -> list[int]:
        ids = []
        while (new := await streamer.queue.get()) is not None:
            ids += new
        return ids

    async def _events(self, body: dict, streamer: TokenQueue, generation: asyncio.Task):
        ids, text = [], ""
        while (new := await streamer.queue.get()) is not None:
            ids += new
            # Decode the whole answer and send what is new: correct across tokens that
            # hold part of a character (held back while the text ends in U+FFFD).
            whole = self.tokenizer.decode(ids)
            if whole.endswith("\ufffd"):
                continue
            piece, text = whole[len(text) :], whole
            yield _sse({"object": "text_completion", "choices": [{"index": 0, "text": piece}]})
        await generation
        prompt_tokens = len(self.tokenizer.encode(body["prompt"]))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids)}
        yield _sse({"object": "text_completion", "choices": [], "usage": usage})
        yield _sse("[DONE]")


def build_app(args: dict):
    """The Serve ``import_path`` target: one replica, one request at a time."""
    deployment = serve.deployment(PipelineBaseline).options(
        name="PipelineBaseline",
        num_replicas=1,
        max_ongoing_requests=1,
        ray_actor_options={
            "num_cpus": float(args.get("num_cpus", 1)),
            "num_gpus": float(args.get("num_gpus", 0)),
        },
    )
    return deployment.bind(args["checkpoint"], int(args.get("num_threads", 0)))
