"""The HTTP routes: OpenAI's chat, completions, models and embeddings, and the plain-text
/generate (a prompt in, the completion's text out); the operators' /health and /metrics
are in :mod:`serve.api.operations`.

Routes validate (schemas), check the configured limits, and hand the work to the
:class:`serve.api.backend.Backend` the ingress puts in ``app.state.backend``.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serve.api.auth import require_api_key
from serve.api.backend import Backend
from serve.api.errors import APIError, NotFound
from serve.api.responses import chat_choice, completion_choice, merge, sse, usage
from serve.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerateRequest,
)
from serve.config import ModelConfig
from serve.generation import GenerateParams

router = APIRouter(dependencies=[Depends(require_api_key)])


async def _backend(request: Request) -> Backend:
    # async: FastAPI runs a plain function dependency in its thread pool, a thread
    # hop per request (14% of the ingress's CPU under load, py-spy).
    return request.app.state.backend


BackendDep = Annotated[Backend, Depends(_backend)]


# Serve's own header for multiplexed models; it names a variant as `model` does.
MULTIPLEXED_HEADER = "serve_multiplexed_model_id"


def _target(
    request: Request, backend: Backend, model_id: str, task: str
) -> tuple[ModelConfig, str | None]:
    """The model (and, in a pool of variants, the variant) a request names."""
    name = request.headers.get(MULTIPLEXED_HEADER) or model_id
    resolved = backend.config.resolve(name)
    if resolved is None or resolved[0].task != task:
        what = "model" if resolved is None else f"{task} model"
        raise NotFound(f"{what} {name!r} does not exist", param="model", code="model_not_found")
    model, variant = resolved
    if model.variants and variant is None:
        raise NotFound(
            f"{name!r} is a pool of variants: send one of {', '.join(model.variants)}",
            param="model",
            code="model_not_found",
        )
    request.state.model = variant or model.id
    return model, variant


def _request_ids(request: Request, count: int) -> list[str]:
    """Triton request ids: Serve's ``x-request-id`` (for log correlation) plus a
    random part, since a client-chosen id may repeat and Triton's ids must not (the
    postprocessing's detokenizer and a cancel are keyed by them)."""
    base = "".join(c for c in request.headers.get("x-request-id", "")[:64] if c.isprintable())
    unique = uuid.uuid4().hex[:12]
    return [f"{base}.{unique}.{i}" if base else f"{unique}.{i}" for i in range(count)]


def _check_prompt_chars(backend: Backend, chars: int, param: str) -> None:
    cap = backend.config.max_prompt_chars
    if chars > cap:
        raise APIError(f"{param} holds {chars} characters, more than the cap of {cap}", param)


def _card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "triton"}


@router.get("/v1/models")
async def list_models(backend: BackendDep):
    return {"object": "list", "data": [_card(i) for i in backend.config.served_ids()]}


@router.get("/v1/models/{model_id}")
async def retrieve_model(model_id: str, backend: BackendDep):
    if model_id not in backend.config.served_ids():
        raise NotFound(f"model {model_id!r} does not exist", param="model", code="model_not_found")
    return _card(model_id)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, backend: BackendDep):
    model, variant = _target(request, backend, body.model, "generate")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    _check_prompt_chars(backend, sum(len(p) for p in prompts), "prompt")
    ids = _request_ids(request, len(prompts))
    params = [
        body.params(p, body.max_tokens, model.max_tokens_cap, model.default_max_tokens, i, variant)
        for p, i in zip(prompts, ids, strict=True)
    ]
    return await _respond(backend, model, body, params, "text_completion")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, backend: BackendDep):
    model, variant = _target(request, backend, body.model, "generate")
    if len(body.messages) > backend.config.max_messages:
        raise APIError(
            f"{len(body.messages)} messages, more than the cap of {backend.config.max_messages}",
            "messages",
        )
    _check_prompt_chars(backend, sum(len(m.content) for m in body.messages), "messages")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt = backend.chat_prompt(model, messages)
    params = body.params(
        prompt,
        body.requested_max_tokens,
        model.max_tokens_cap,
        model.default_max_tokens,
        _request_ids(request, 1)[0],
        variant,
    )
    return await _respond(backend, model, body, [params], "chat.completion")


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, backend: BackendDep):
    model, _ = _target(request, backend, body.model, "embed")
    _check_prompt_chars(backend, sum(len(t) for t in body.texts), "input")
    result = await backend.embed(model, body.texts)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(vector, body.encoding_format)}
        for i, vector in enumerate(result.vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model.id,
        "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens},
    }


def _encode(vector, encoding_format: str):
    if encoding_format == "base64":  # little-endian float32, as OpenAI's SDK decodes it
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


@router.get("/generate")
async def generate_get(
    request: Request,
    query: str,
    backend: BackendDep,
    max_new_tokens: Annotated[int | None, Query(ge=1)] = None,
):
    return await generate_post(
        GenerateRequest(prompt=query, max_new_tokens=max_new_tokens), request, backend
    )


@router.post("/generate")
async def generate_post(body: GenerateRequest, request: Request, backend: BackendDep):
    model, variant = backend.config.default_target
    request.state.model = variant or model.id
    _check_prompt_chars(backend, len(body.prompt), "prompt")
    params = CompletionRequest(model=model.id, prompt=body.prompt).params(
        body.prompt,
        body.max_new_tokens,
        model.max_tokens_cap,
        model.default_max_tokens,
        _request_ids(request, 1)[0],
        variant,
    )
    text, _ = await backend.collect(model, params)
    return {"text": text}


async def _respond(backend: Backend, model: ModelConfig, body, params: list[GenerateParams], kind):
    choice = chat_choice if kind == "chat.completion" else completion_choice
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    served = params[0].variant or model.id
    base = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": served}
    if not body.stream:
        results = await _gather(backend.collect(model, p) for p in params)
        choices = [
            choice(i, text, last.finish_reason, False) for i, (text, last) in enumerate(results)
        ]
        answer = {
            **base,
            "object": kind,
            "choices": choices,
            "usage": usage([r[1] for r in results]),
        }
        return JSONResponse(answer)
    starts = await _start_all(backend, model, params)
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind

    def event(choices: list[dict], **extra) -> str:
        return sse({**base, "object": chunk_kind, "choices": choices, **extra})

    async def events():
        lasts = [first for first, _ in starts]
        try:
            if chunk_kind == "chat.completion.chunk":
                role = {"role": "assistant", "content": ""}
                yield event([{"index": 0, "delta": role, "finish_reason": None}])
            async for index, chunk in merge(starts):
                lasts[index] = chunk
                if chunk.text or chunk.finish_reason:
                    yield event([choice(index, chunk.text, chunk.finish_reason, True)])
            if body.include_usage:
                yield event([], usage=usage(lasts))
        except APIError as error:  # mid-stream: an error event, never a cut stream
            yield sse(error.body())
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


async def _gather(awaitables):
    """All results, or the first failure after every other task has ended."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def _start_all(backend: Backend, model: ModelConfig, params: list[GenerateParams]):
    """Every prompt's first chunk (errors become the HTTP status) and its rest."""
    started = await asyncio.gather(
        *(backend.start(model, p) for p in params), return_exceptions=True
    )
    failures = [s for s in started if isinstance(s, BaseException)]
    if failures:
        for item in started:
            if not isinstance(item, BaseException):
                await item[1].aclose()
        raise failures[0]
    return started
