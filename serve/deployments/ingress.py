"""The HTTP front door: OpenAI-compatible routes and the seed's /generate.

Generation goes to the Triton replicas through a streaming DeploymentHandle.
When a client disconnects, Starlette cancels the response task; cancelling the
handle's generator makes Serve cancel the replica's ``generate``, whose host
then stops the engine's sequence.
"""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from serve.api.chat_template import render_chat_prompt
from serve.api.errors import APIError, InternalError, NotFound, Overloaded, install_handlers
from serve.api.schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest
from serve.config import AppConfig
from serve.triton.host import GenerationError
from serve.triton.requests import GenerateParams, GenerationChunk

app = FastAPI(title="triton-ray-llm")
install_handlers(app)


def _as_api_error(error: GenerationError) -> APIError:
    if error.kind == GenerationError.INVALID:
        return APIError(str(error))
    if error.kind == GenerationError.UNAVAILABLE:
        return Overloaded(str(error))
    return InternalError(str(error))


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _completion_choice(index: int, text: str, finish_reason: str | None, _stream: bool) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _chat_choice(index: int, text: str, finish_reason: str | None, streaming: bool) -> dict:
    body = {"content": text} if streaming else {"role": "assistant", "content": text}
    key = "delta" if streaming else "message"
    return {
        "index": index,
        key: body if (text or not streaming) else {},
        "finish_reason": finish_reason,
    }


def _usage(lasts: list[GenerationChunk]) -> dict:
    prompt = sum(last.num_input_tokens for last in lasts)
    completion = sum(last.num_output_tokens for last in lasts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _merge(starts) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """Interleave several started streams as ``(index, chunk)`` in arrival order."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, first: GenerationChunk, rest) -> None:
        try:
            await queue.put((index, first))
            async for chunk in rest:
                await queue.put((index, chunk))
        except APIError as error:
            await queue.put((index, error))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, first, rest)) for i, (first, rest) in enumerate(starts)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield index, item
    finally:  # done, failed or the client left: every replica stream is closed
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, rest in starts:
            await rest.aclose()


# Decorated here, not in build_app: the replica process imports this module, and
# Serve's class-based-view fix to the routes must happen in that import too. (The
# helpers above are defined first for the same reason; and no postponed
# annotations here, or FastAPI cannot tell a body model from a query parameter.)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, replica, config: AppConfig):
        from tritonllm.tokenization import load_tokenizer

        self.replica = replica
        self.config = config
        app.state.max_body_bytes = config.max_body_bytes
        self.tokenizer = load_tokenizer(str(config.tokenizer_dir()))

    # -- generation plumbing ----------------------------------------------------------

    async def _stream(self, params: GenerateParams) -> AsyncIterator[GenerationChunk]:
        """The replica's chunks; the first one is awaited before any byte goes out,
        so an error in it becomes a proper HTTP status."""
        responses = self.replica.options(stream=True).generate.remote(params)
        try:
            async for chunk in responses:
                yield chunk
        except GenerationError as error:
            raise _as_api_error(error) from None
        finally:
            responses.cancel()  # a no-op once finished; frees the engine otherwise

    async def _collect(self, params: GenerateParams) -> tuple[str, GenerationChunk]:
        text = []
        async for chunk in self._stream(params):
            text.append(chunk.text)
        return "".join(text), chunk

    async def _start(self, params: GenerateParams):
        """Peek the first chunk (errors surface here) and return it with the rest."""
        stream = self._stream(params)
        first = await stream.__anext__()
        return first, stream

    def _check_model(self, model: str) -> None:
        if model != self.config.model_id:
            raise NotFound(f"model {model!r} does not exist", param="model", code="model_not_found")

    def _chat_prompt(self, request: ChatCompletionRequest) -> str:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        return render_chat_prompt(self.tokenizer, messages)

    # -- routes -------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model_id}")
    async def model(self, model_id: str):
        self._check_model(model_id)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.config.model_id, "object": "model", "created": 0, "owned_by": "triton"}

    @app.post("/v1/completions")
    async def completions(self, request: CompletionRequest):
        self._check_model(request.model)
        prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        params = [
            request.params(
                prompt,
                request.max_tokens,
                self.config.max_tokens_cap,
                self.config.default_max_tokens,
            )
            for prompt in prompts
        ]
        return await self._respond(request, params, "text_completion", _completion_choice)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: ChatCompletionRequest):
        self._check_model(request.model)
        params = request.params(
            self._chat_prompt(request),
            request.requested_max_tokens,
            self.config.max_tokens_cap,
            self.config.default_max_tokens,
        )
        return await self._respond(request, [params], "chat.completion", _chat_choice)

    @app.get("/generate")
    async def generate_get(self, query: str, max_new_tokens: int | None = Query(None, ge=1)):
        return await self.generate_post(
            GenerateRequest(prompt=query, max_new_tokens=max_new_tokens)
        )

    @app.post("/generate")
    async def generate_post(self, request: GenerateRequest):
        params = CompletionRequest(model=self.config.model_id, prompt=request.prompt).params(
            request.prompt,
            request.max_new_tokens,
            self.config.max_tokens_cap,
            self.config.default_max_tokens,
        )
        text, _ = await self._collect(params)
        return {"text": text}

    # -- OpenAI response shapes -----------------------------------------------------------

    async def _respond(self, request, params: list[GenerateParams], kind: str, choice):
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        created, rid = int(time.time()), f"{prefix}-{uuid.uuid4().hex}"
        base = {"id": rid, "created": created, "model": self.config.model_id}
        if not request.stream:
            results = await asyncio.gather(*(self._collect(p) for p in params))
            choices = [
                choice(i, text, last.finish_reason, False) for i, (text, last) in enumerate(results)
            ]
            usage = _usage([last for _, last in results])
            return JSONResponse({**base, "object": kind, "choices": choices, "usage": usage})
        starts = await self._start_all(params)
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind

        def event(choices: list[dict], **extra) -> str:
            return _sse({**base, "object": chunk_kind, "choices": choices, **extra})

        async def events():
            lasts = [first for first, _ in starts]
            try:
                if chunk_kind == "chat.completion.chunk":
                    role = {"role": "assistant", "content": ""}
                    yield event([{"index": 0, "delta": role, "finish_reason": None}])
                async for index, chunk in _merge(starts):
                    lasts[index] = chunk
                    if chunk.text or chunk.finish_reason:
                        yield event([choice(index, chunk.text, chunk.finish_reason, True)])
                if request.include_usage:
                    yield event([], usage=_usage(lasts))
            except APIError as error:  # mid-stream: an error event, never a cut stream
                yield _sse(error.body())
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _start_all(self, params: list[GenerateParams]):
        """Every prompt's first chunk (errors become the HTTP status) and its rest."""
        started = await asyncio.gather(*(self._start(p) for p in params), return_exceptions=True)
        failures = [s for s in started if isinstance(s, BaseException)]
        if failures:
            for item in started:
                if not isinstance(item, BaseException):
                    await item[1].aclose()
            raise failures[0]
        return started
