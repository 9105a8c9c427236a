"""The HTTP routes: OpenAI's chat, completions, models and embeddings, and the plain-text
/generate (a prompt in, the completion's text out); the operators' /health and /metrics
are in :mod:`serve.api.operations`.

Routes validate (schemas), check the configured limits, and hand the work to the
:class:`serve.api.common.backend.Backend` the ingress puts in ``app.state.backend``.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from serve.api.common.answer import Answer, AnswerStream, Reading, start_answer, whole_answer
from serve.api.common.auth import caller, require_api_key
from serve.api.common.backend import Backend
from serve.api.common.errors import APIError, InternalError, NotFound
from serve.api.common.sse import EventStream, LastEvents, json_response, sse
from serve.api.openai.endpoints import (
    CHAT,
    COMPLETIONS,
    ChunkEvents,
    Endpoint,
    merge,
)
from serve.api.openai.fields import SamplingFields
from serve.api.openai.log_probs import LogProbs
from serve.api.openai.prepare import (
    BackendDep,
    chat_turn,
    check_prompt_chars,
    choices,
    guided,
    request_ids,
    served_id,
    target,
)
from serve.api.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    GenerateRequest,
)
from serve.api.openai.shapes import (
    Embedding,
    EmbeddingList,
    EmbeddingUsage,
    ModelCard,
    ModelList,
    Usage,
)
from serve.config import ModelConfig
from serve.generation import GenerateParams

log = logging.getLogger("ray.serve")

router = APIRouter(dependencies=[Depends(require_api_key)])


async def _cards(backend: Backend, request: Request) -> list[ModelCard]:
    """Every id the caller may send: the models (those of its tenant), variants, and
    the adapters found now."""
    cards, allowed = [], caller(request).may_use
    for model in backend.config.models:
        if not allowed(model.id):
            continue
        cards += [ModelCard.of(i) for i in model.served_ids()]
        if model.lora:
            found = await backend.adapters(model)
            cards += [ModelCard.of(model.adapter_id(name), model.id) for name in found]
            aliases = model.lora.aliases.items()
            cards += [ModelCard.of(alias, model.id) for alias, name in aliases if name in found]
    return cards


@router.get("/v1/models")
async def list_models(request: Request, backend: BackendDep):
    return json_response(ModelList(object="list", data=await _cards(backend, request)))


@router.get("/v1/models/{model_id}")
async def retrieve_model(model_id: str, request: Request, backend: BackendDep):
    card = next((c for c in await _cards(backend, request) if c.id == model_id), None)
    if card is None:
        raise NotFound(f"model {model_id!r} does not exist", param="model", code="model_not_found")
    return json_response(card)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, backend: BackendDep):
    model, variant = target(request, backend, body.model, "generate")
    prompts = body.prompts
    if isinstance(prompts[0], str):
        check_prompt_chars(backend, sum(len(p) for p in prompts), "prompt")
    else:
        _check_token_ids(backend, model, prompts)
    guide = await guided(body.output_guide, body)
    prompt_alone = body.max_tokens == 0
    if prompt_alone and not body.echo:
        raise APIError(
            "max_tokens must be at least 1; 0 is taken with echo (the prompt alone, with its "
            "log probabilities when logprobs is set)",
            "max_tokens",
        )
    # The engines generate at least one token: the prompt alone asks for one, then drops it.
    max_tokens = 1 if prompt_alone else body.max_tokens
    params = choices(request, body, model, variant, prompts, max_tokens, guide)
    echoes = [_prompt_text(backend, model, p) if body.echo else "" for p in params]
    if prompt_alone:
        return await _prompts_alone(backend, model, body, params, echoes)
    readings = [
        Reading(p.stop, keep_stop=body.include_stop_str_in_output, echo=echo)
        for p, echo in zip(params, echoes, strict=True)
    ]
    return await _respond(backend, model, body, params, COMPLETIONS, readings)


def _check_token_ids(backend: Backend, model: ModelConfig, prompts: list[list[int]]) -> None:
    vocab = backend.vocab_size(model)
    for i, ids in enumerate(prompts):
        if len(ids) > backend.config.max_prompt_chars:
            raise APIError(f"prompt {i} holds {len(ids)} tokens, more than the cap", "prompt")
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise APIError(
                f"prompt {i} holds token ids outside the vocabulary [0, {vocab}): {outside[:5]}",
                "prompt",
            )


async def _prompts_alone(backend, model, body: CompletionRequest, params, echoes):
    """An echo with max_tokens 0, as scoring clients send it: each prompt's text and
    (with logprobs) its tokens' log probabilities, nothing generated or counted."""
    results = await _gather(backend.collect(model, p) for p in params)
    lasts = [
        dataclasses.replace(
            last,
            text=echo,
            token_ids=(),
            token_log_probs=(),
            top_log_probs=(),
            cum_log_prob=None,
            num_output_tokens=0,
            finish_reason="length",
        )
        for (_, last), echo in zip(results, echoes, strict=True)
    ]
    head = COMPLETIONS.head(served_id(model, params[0]))
    log_probs = LogProbs(backend, model, COMPLETIONS, echoes) if body.logprobs is not None else None
    if body.stream:
        streams = [AnswerStream(last, _nothing(), Reading()) for last in lasts]
        return EventStream(_events(body, streams, COMPLETIONS, head, log_probs))
    answers = [Answer(last.text, [], "length", None, last) for last in lasts]
    return json_response(_whole(answers, COMPLETIONS, head, log_probs))


async def _nothing():
    return
    yield


def _prompt_text(backend: Backend, model: ModelConfig, params: GenerateParams) -> str:
    if not params.prompt_token_ids:
        return params.prompt
    return backend.token_texts(model).prompt_text(params.prompt_token_ids)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, backend: BackendDep):
    turn = await guided(functools.partial(chat_turn, body, request, backend), body)
    readings = [turn.reading(body.include_stop_str_in_output)] * len(turn.params)
    return await _respond(backend, turn.model, body, turn.params, CHAT, readings)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, backend: BackendDep):
    model, _ = target(request, backend, body.model, "embed")
    check_prompt_chars(backend, sum(len(t) for t in body.texts), "input")
    result = await backend.embed(model, body.texts)
    data = [
        Embedding(object="embedding", index=i, embedding=_encode(vector, body.encoding_format))
        for i, vector in enumerate(result.vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=result.num_tokens, total_tokens=result.num_tokens)
    return json_response(EmbeddingList(object="list", data=data, model=model.id, usage=usage))


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
    if not caller(request).may_use(model.id):
        raise NotFound(f"/generate runs {model.id!r}, which this API key may not use")
    request.state.model = variant or model.id
    check_prompt_chars(backend, len(body.prompt), "prompt")
    params = CompletionRequest(model=model.id, prompt=body.prompt).params(
        body.prompt,
        body.max_new_tokens,
        model.max_tokens_cap,
        model.default_max_tokens,
        request_ids(request, 1)[0],
        variant,
        defaults=backend.sampling_defaults(model),
    )
    text, _ = await backend.collect(model, params)
    return {"text": text}


async def _respond(
    backend: Backend,
    model: ModelConfig,
    body: SamplingFields,
    params: list[GenerateParams],
    endpoint: Endpoint,
    readings: list[Reading],
):
    """Each choice's answer (one per params, read as its reading says), whole or
    streamed, in the shape of ``endpoint``."""
    head = endpoint.head(served_id(model, params[0]))
    echoes = [reading.echo for reading in readings]
    log_probs = LogProbs(backend, model, endpoint, echoes) if params[0].return_log_probs else None
    choices = list(zip(params, readings, strict=True))
    if not body.stream:
        answers = await _gather(whole_answer(backend, model, p, r) for p, r in choices)
        return json_response(_whole(answers, endpoint, head, log_probs))
    streams = await _start_all(start_answer(backend, model, p, r) for p, r in choices)
    return EventStream(_events(body, streams, endpoint, head, log_probs))


def _whole(answers: list[Answer], endpoint: Endpoint, head: dict, log_probs):
    choices = [
        endpoint.choice(
            i,
            answer.content,
            answer.finish_reason,
            log_probs and log_probs(i, answer.last),
            [call.as_message() for call in answer.calls],
        )
        for i, answer in enumerate(answers)
    ]
    return endpoint.answer(head, choices, Usage.of([answer.last for answer in answers]))


async def _events(body: SamplingFields, streams, endpoint: Endpoint, head: dict, log_probs):
    """The SSE events of started choices: a chunk for each step that adds text, a tool
    call's piece, tokens (where their log probabilities were asked for) or the end; the
    usage chunk; [DONE].

    Events that are ready together leave together (one write each time): the
    openings with the first chunk, the last choice's final chunk with the usage and
    [DONE], as :class:`LastEvents`."""
    event = ChunkEvents(endpoint, head)
    held = [event([opening]) for opening in endpoint.openings(len(streams))]
    finished = 0
    failure = None
    try:
        async for index, (text, calls, chunk, finish) in merge(streams):
            if text or calls or finish or (log_probs and chunk.token_ids):
                usage = _usage(streams) if body.continuous_usage else None
                calls = calls and calls.tool_call_deltas()
                shaped = log_probs and log_probs(index, chunk)
                choice = endpoint.chunk_choice(index, text, finish, shaped, calls)
                held.append(event([choice], usage))
            finished += finish is not None
            if held and finished < len(streams):  # else the stream's end follows at once
                yield "".join(held)
                held.clear()
    except APIError as error:  # mid-stream: an error event, never a cut stream
        failure = error
    except Exception:
        log.exception("stream %s failed after its first byte", head["id"])
        failure = InternalError("internal server error; see the server log")
    if body.include_usage:  # what was generated, also when the stream failed
        held.append(event([], _usage(streams)))
    if failure is not None:
        held.append(sse(failure.body()))
    yield LastEvents("".join([*held, sse("[DONE]")]))


def _usage(streams: list[AnswerStream]) -> Usage:
    return Usage.of([stream.latest for stream in streams])


async def _gather(awaitables):
    """All results, or the first failure after every other task has ended."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def _start_all(starting) -> list[AnswerStream]:
    """Every choice started (errors become the HTTP status: the others are closed)."""
    started = await asyncio.gather(*starting, return_exceptions=True)
    failures = [s for s in started if isinstance(s, BaseException)]
    if failures:
        for stream in started:
            if not isinstance(stream, BaseException):
                await stream.aclose()
        raise failures[0]
    return started
