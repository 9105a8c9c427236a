"""Backends that stand in for the replicas in the HTTP layer's tests: the routes,
errors and shapes are what those test, over answers these script."""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import numpy as np
from fastapi.testclient import TestClient

from serve.api.common.backend import Embeddings
from serve.api.common.keyring import Keyring
from serve.api.common.sampling import GREEDY
from serve.api.common.token_texts import TokenTexts
from serve.api.http import create_app
from serve.api.openai.responses.store import MemoryStore
from serve.config import AppConfig
from serve.engines.triton.requests import final_chunk
from serve.generation import GenerationChunk, PromptLogProbs, TopLogProbs

CONFIG = AppConfig.model_validate(
    {
        "models": [
            {"id": "llm", "max_tokens_cap": 16, "default_max_tokens": 4},
            {"id": "emb", "task": "embed"},
        ],
        "max_body_bytes": 4096,
        "max_prompt_chars": 1000,
        "max_messages": 3,
    }
)

END_ID = 99  # the fake tokenizer's end token


class FakeTokenizer:
    """Token i's text is ``<i>``; the end token's is ``</s>``, a special token."""

    eos_token_id = END_ID

    def decode(self, ids, skip_special_tokens=False):
        special = "" if skip_special_tokens else "</s>"
        return "".join(special if i == END_ID else f"<{i}>" for i in ids)


def end_token(end: GenerationChunk, params) -> GenerationChunk:
    """The answer's end, with the end token's log probability where it ended the answer
    (the engines' ``logs_end_token``): -9, its alternatives the end token and 0, 1, ..."""
    if not params.return_log_probs or end.finish_reason != "stop":
        return end
    top = TopLogProbs((END_ID, *range(params.top_log_probs - 1)), (-9.0,) * params.top_log_probs)
    return dataclasses.replace(
        end, token_log_probs=(-9.0,), top_log_probs=(top,) if params.top_log_probs else ()
    )


def prompt_log_probs(length: int, k: int) -> PromptLogProbs:
    ids = tuple(range(50, 50 + length))
    tops = [TopLogProbs(tuple(range(t, t + k)), (-0.25,) * k) for t in ids[1:]]
    return PromptLogProbs(ids, (None, *(-0.5,) * (length - 1)), (None, *tops) if k else ())


class FakeBackend:
    """Answers with the prompt's words, one per chunk, up to max_tokens."""

    config = CONFIG

    def __init__(self, fail_after: int | None = None, error: Exception | None = None):
        self.defaults = GREEDY  # what the checkpoint's generation_config.json asks for
        self.fail_after = fail_after  # raise `error` after this many chunks
        self.error = error
        self.params = []
        self.waiting: dict[str, str] = {}  # what not_ready() answers: model id -> reason
        self.alternatives = True  # top-k and prompt log probabilities (not TensorRT-LLM)
        self.response_store = None  # /v1/responses keeps nothing (tests give it a store)
        self.fair_queues = {}  # fair shares off (tests give it queues)
        self.tenant_tokens: dict[str, list[int]] = {}  # tenant: [prompt, completion]

    def chat_prompt(self, model, messages, tools=None):
        return " ".join(m["content"] for m in messages)

    def sampling_defaults(self, model):
        return self.defaults

    def serves_alternatives(self, model):
        return self.alternatives

    def takes_priority(self, model):
        return True

    async def _chunks(self, params):
        self.params.append(params)
        prompt = params.prompt.split() or [f"t{i}" for i in params.prompt_token_ids]
        last = None
        for i, word in enumerate(prompt[: params.max_tokens]):
            if self.fail_after is not None and i >= self.fail_after:
                raise self.error
            last = GenerationChunk(" " + word, len(prompt), i + 1)
            if params.return_log_probs:  # token i of the answer has id i, log prob -i
                last = dataclasses.replace(last, token_ids=(i,), token_log_probs=(-float(i),))
            if params.top_log_probs:  # its alternatives: ids i, i+1, ..., log probs -i, -i-1 ...
                ids = tuple(range(i, i + params.top_log_probs))
                top = TopLogProbs(ids, tuple(-float(t) for t in ids))
                last = dataclasses.replace(last, top_log_probs=(top,))
            if params.prompt_log_probs and i == 0:  # the prompt's words: ids 50, 51, ...
                last = dataclasses.replace(
                    last, prompt=prompt_log_probs(len(prompt), params.top_log_probs)
                )
            yield last
        yield end_token(final_chunk(last, params), params)

    async def start(self, model, params):
        stream = self._chunks(params)
        return await stream.__anext__(), stream

    async def collect(self, model, params):
        whole = functools.reduce(GenerationChunk.merged, [c async for c in self._chunks(params)])
        return whole.text, whole

    def token_texts(self, model):
        return TokenTexts(FakeTokenizer())

    def vocab_size(self, model):
        return 100

    def count_prompt_tokens(self, model, prompt):
        return len(prompt.split())  # as _chunks counts a prompt's tokens: its words

    async def embed(self, model, texts):
        vectors = np.array([[len(t), 1.5, -2.0] for t in texts], dtype=np.float32)
        return Embeddings(vectors, sum(len(t.split()) for t in texts))

    def count_tenant_tokens(self, tenant, prompt, completion):
        counted = self.tenant_tokens.setdefault(tenant, [0, 0])
        counted[0], counted[1] = counted[0] + prompt, counted[1] + completion

    async def not_ready(self):
        return dict(self.waiting)

    async def metrics_text(self):
        if self.error is not None:
            raise self.error
        return "# TYPE up gauge\nup 1\n"


class EndlessBackend(FakeBackend):
    """Streams a word, then waits for ever (an engine still generating); says when
    its stream was closed."""

    def __init__(self):
        super().__init__()
        self.closed = asyncio.Event()

    async def _chunks(self, params):
        try:
            yield GenerationChunk(" first", 1, 1)
            await asyncio.Event().wait()
        finally:
            self.closed.set()


def client(backend=None, keys=(), record=None) -> TestClient:
    app = create_app(backend or FakeBackend(), Keyring(keys), record)
    return TestClient(app, raise_server_exceptions=False)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


TOOLS_CONFIG = AppConfig.model_validate(
    {
        "models": [
            {"id": "llm", "max_tokens_cap": 64, "tool_call_parser": "hermes"},
            {"id": "plain", "max_tokens_cap": 64},  # no tool_call_parser
        ]
    }
)


class ScriptedBackend(FakeBackend):
    """Answers every request with ``answer``, a few characters per chunk."""

    config = TOOLS_CONFIG

    def __init__(self, answer: str = "hello", piece: int = 3, finish: str = "stop"):
        super().__init__()
        self.answer, self.piece, self.finish = answer, piece, finish
        self.rendered = []  # (messages, tools) each chat_prompt call got

    def chat_prompt(self, model, messages, tools=None):
        self.rendered.append((messages, tools))
        return "prompt"

    async def _chunks(self, params):
        self.params.append(params)
        pieces = [self.answer[i : i + self.piece] for i in range(0, len(self.answer), self.piece)]
        last = None
        for i, text in enumerate(pieces):
            last = GenerationChunk(text, 1, i + 1)
            yield last
        end = final_chunk(last, params)
        yield GenerationChunk(
            "", end.num_input_tokens, end.num_output_tokens, finish_reason=self.finish
        )


class StoringBackend(ScriptedBackend):
    def __init__(self, answer: str = "hello", **kwargs):
        super().__init__(answer, **kwargs)
        self.response_store = MemoryStore(max_bytes=1 << 20, ttl_s=60)


def post(backend, body, path="/v1/chat/completions"):
    app = create_app(backend)
    return TestClient(app, raise_server_exceptions=False).post(path, json=body)
