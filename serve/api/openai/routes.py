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

from serve.api.common.auth import caller, require_api_key
from serve.api.common.backend import Backend
from serve.api.common.errors import APIError, InternalError, NotFound
from serve.api.common.sse import EventStream, LastEvents, json_response, sse
from serve.api.common.stops import cut_stream, cut_text
from serve.api.common.tool_parsers import CallSyntax, ToolCallParser, parse_whole
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
    ChatChunkChoice,
    Embedding,
    EmbeddingList,
    EmbeddingUsage,
    ModelCard,
    ModelList,
    Usage,
)
from serve.config import ModelConfig
from serve.generation import GenerateParams, GenerationChunk

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
    return await _respond(backend, model, body, params, COMPLETIONS, echoes)


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
        starts = [(last, _nothing()) for last in lasts]
        return EventStream(_events(body, starts, COMPLETIONS, head, log_probs))
    answers = [
        COMPLETIONS.choice(i, last.text, last.finish_reason, log_probs and log_probs(i, last))
        for i, last in enumerate(lasts)
    ]
    return json_response(COMPLETIONS.answer(head, answers, Usage.of(lasts)))


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
    return await _respond(backend, turn.model, body, turn.params, CHAT, syntax=turn.syntax)


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
    echoes: list[str] | None = None,
    syntax: CallSyntax | None = None,
):
    head = endpoint.head(served_id(model, params[0]))
    echoes = echoes or [""] * len(params)
    log_probs = LogProbs(backend, model, endpoint, echoes) if params[0].return_log_probs else None
    if not body.stream:
        return await _whole(backend, model, body, params, endpoint, echoes, head, log_probs, syntax)
    starts = await _start_all(backend, model, params)
    starts = [
        await _cut_and_echoed(first, rest, p, echo, body.include_stop_str_in_output)
        for (first, rest), p, echo in zip(starts, params, echoes, strict=True)
    ]
    return EventStream(_events(body, starts, endpoint, head, log_probs, syntax))


async def _whole(backend, model, body, params, endpoint, echoes, head, log_probs, syntax):
    results = await _gather(backend.collect(model, p) for p in params)
    choices = []
    for i, (p, (text, last)) in enumerate(zip(params, results, strict=True)):
        finish = last.finish_reason
        if p.stop:
            text, stopped = cut_text(text, p.stop, body.include_stop_str_in_output)
            finish = "stop" if stopped else finish
        shaped = log_probs and log_probs(i, last)
        if syntax is None:
            choices.append(endpoint.choice(i, echoes[i] + text, finish, shaped))
            continue
        content, calls = parse_whole(syntax, text)
        calls = [call.as_message() for call in calls]
        choices.append(CHAT.choice(i, content, _finish(finish, calls), shaped, calls))
    return json_response(endpoint.answer(head, choices, Usage.of(_last_chunks(results))))


def _finish(reason: str | None, calls) -> str | None:
    """An answer that called tools and ended on its own ends with ``tool_calls``."""
    return "tool_calls" if calls and reason == "stop" else reason


async def _events(
    body: SamplingFields, starts, endpoint: Endpoint, head: dict, log_probs, syntax=None
):
    """The SSE events of started choices: chunks as they come, the usage chunk, [DONE].

    Events that are ready together leave together (one write each time): the
    openings with the first chunk, the last choice's final chunk with the usage and
    [DONE], as :class:`LastEvents`."""
    event = ChunkEvents(endpoint, head)

    lasts = [first for first, _ in starts]
    parsers = [ToolCallParser(syntax) for _ in starts] if syntax else None
    held = [event([opening]) for opening in endpoint.openings(len(starts))]
    finished = 0
    failure = None
    try:
        async for index, chunk in merge(starts):
            lasts[index] = chunk
            if chunk.text or chunk.finish_reason or (log_probs and chunk.token_ids):
                usage = Usage.of(lasts) if body.continuous_usage else None
                shaped = log_probs and log_probs(index, chunk)
                if parsers is None:
                    shaped_choice = endpoint.chunk_choice(
                        index, chunk.text, chunk.finish_reason, shaped
                    )
                else:
                    shaped_choice = _call_chunk(parsers[index], index, chunk, shaped)
                if shaped_choice is not None:
                    held.append(event([shaped_choice], usage))
            finished += bool(chunk.finish_reason)
            if held and finished < len(starts):  # else the stream's end follows at once
                yield "".join(held)
                held.clear()
    except APIError as error:  # mid-stream: an error event, never a cut stream
        failure = error
    except Exception:
        log.exception("stream %s failed after its first byte", head["id"])
        failure = InternalError("internal server error; see the server log")
    if body.include_usage:  # what was generated, also when the stream failed
        held.append(event([], Usage.of(lasts)))
    if failure is not None:
        held.append(sse(failure.body()))
    yield LastEvents("".join([*held, sse("[DONE]")]))


def _call_chunk(parser: ToolCallParser, index: int, chunk, log_probs) -> ChatChunkChoice | None:
    """A chat chunk with the content and ``delta.tool_calls`` its text adds (None: the
    text is held back, a call's opening perhaps, and nothing else is new)."""
    delta = parser.feed(chunk.text)
    finish = chunk.finish_reason
    if finish:
        delta.content += parser.finish().content
        finish = _finish(finish, parser.calls)
    if not (delta or finish or log_probs):
        return None
    return CHAT.chunk_choice(index, delta.content, finish, log_probs, delta.tool_call_deltas())


def _last_chunks(results) -> list[GenerationChunk]:
    """Each choice's last chunk (its token counts), from its (text, last chunk)."""
    return [last for _, last in results]


async def _cut_and_echoed(first, rest, params: GenerateParams, echo: str, keep_stop: bool):
    """A started choice with its stop strings cut and the echoed prompt before its text."""
    if not (params.stop or echo):
        return first, rest
    stream = _chained(first, rest)
    if params.stop:
        stream = cut_stream(stream, params.stop, keep_stop)
    first = await stream.__anext__()  # the chunk already received: no wait
    return dataclasses.replace(first, text=echo + first.text), stream


async def _chained(first, rest):
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


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
