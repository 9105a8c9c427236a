"""What every generating route does before it generates: find the model the request
names, hold the request to the configured limits, and build its engine requests.

Chat turns come from three APIs (chat completions, Responses, Messages); each turns its
request into a :class:`ChatCompletionRequest` and calls :func:`chat_turn`, so the chat
template, the limits, the output's guide and the call syntax are the same for all.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from serve.api.common.answer import (
    Answer,
    AnswerStream,
    LogProbsOf,
    Reading,
    start_answer,
    whole_answer,
)
from serve.api.common.auth import caller
from serve.api.common.backend import Backend
from serve.api.common.errors import APIError, NotFound
from serve.api.common.metered import MeteredBackend, SeatedBackend
from serve.api.common.middleware import request_state
from serve.api.common.structured import Guide, tool_guide
from serve.api.common.tool_parsers import SYNTAXES, CallSyntax
from serve.api.openai.fields import (
    MAX_CHOICES,
    SamplingFields,
)
from serve.api.openai.schemas import ChatCompletionRequest
from serve.config import ModelConfig
from serve.generation import GenerateParams


async def _backend(request: Request) -> Backend:
    """The app's backend, as the request's caller sees it: its fair share of each model
    where fair shares are on (any caller, an open API's too: priorities), and for a
    keyed caller its tokens counted, and held to its tokens per minute where it has that
    limit (serve/api/common/metered.py)."""
    # async: FastAPI runs a plain function dependency in its thread pool, a thread
    # hop per request.
    backend = request.app.state.backend
    if backend.fair_queues:
        backend = SeatedBackend(backend, request, caller(request))
    tenant = request_state(request, "caller")  # set by a key that let it in
    if tenant is None:
        return backend
    return MeteredBackend(backend, request, tenant, request.app.state.buckets)


BackendDep = Annotated[Backend, Depends(_backend)]


T = TypeVar("T")

# Serve's own header for multiplexed models; it names a variant as `model` does.
MULTIPLEXED_HEADER = "serve_multiplexed_model_id"


def target(
    request: Request, backend: Backend, model_id: str, task: str
) -> tuple[ModelConfig, str | None]:
    """The model a request names and, in a pool of variants, the variant or, for a
    model with ``lora``, the adapter (whose existence the backend checks)."""
    name = request.headers.get(MULTIPLEXED_HEADER) or model_id
    resolved = backend.config.resolve(name)
    if resolved is not None and not caller(request).may_use(resolved[0].id):
        resolved = None  # a model the caller's tenant may not use is one it cannot see
    if resolved is None or resolved[0].task != task:
        what = "model" if resolved is None else f"{task} model"
        raise NotFound(f"{what} {name!r} does not exist", param="model", code="model_not_found")
    model, entry = resolved
    if model.variants and entry is None:
        raise NotFound(
            f"{name!r} is a pool of variants: send one of {', '.join(model.variants)}",
            param="model",
            code="model_not_found",
        )
    # The metrics label: a variant (a configured few), never an adapter (found at runtime).
    request.state.model = model.id if model.lora else entry or model.id
    return model, entry


def served_id(model: ModelConfig, params: GenerateParams) -> str:
    """The model id an answer names: the variant, ``<base>:<adapter>``, or the model."""
    if params.adapter is not None:
        return model.adapter_id(params.adapter)
    return params.variant or model.id


def request_ids(request: Request, count: int) -> list[str]:
    """Triton request ids: Serve's ``x-request-id`` (for log correlation) plus a
    random part, since a client-chosen id may repeat and Triton's ids must not (the
    postprocessing's detokenizer and a cancel are keyed by them)."""
    base = "".join(c for c in request.headers.get("x-request-id", "")[:64] if c.isprintable())
    unique = os.urandom(6).hex()  # what uuid4().hex[:12] was, without the UUID object
    return [f"{base}.{unique}.{i}" if base else f"{unique}.{i}" for i in range(count)]


def check_prompt_chars(backend: Backend, chars: int, param: str) -> None:
    cap = backend.config.max_prompt_chars
    if chars > cap:
        raise APIError(f"{param} holds {chars} characters, more than the cap of {cap}", param)


def choices(
    request: Request,
    body: SamplingFields,
    model: ModelConfig,
    entry: str | None,
    prompts: list[str],
    max_tokens: int | None,
    guide: Guide | None = None,
) -> list[GenerateParams]:
    """One engine request per choice: ``n`` for each prompt, in OpenAI's order (the
    ``j``-th choice of prompt ``i`` has index ``i * n + j``); ``entry`` is what
    :func:`target` found (a variant or an adapter)."""
    variant, adapter = (None, entry) if model.lora else (entry, None)
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(
            f"{len(prompts)} prompts x n={body.n} is more than {MAX_CHOICES} choices", "n"
        )
    backend = request.app.state.backend
    _check_log_probs(backend, model, body)
    ids = iter(request_ids(request, len(prompts) * body.n))
    cap, default = model.max_tokens_cap, model.default_max_tokens
    defaults = backend.sampling_defaults(model)
    # An engine without priorities (TensorRT-LLM's, vLLM's default) serves in turn.
    priority = caller(request).priority_of(body.priority) if backend.takes_priority(model) else 0
    return [
        body.params(
            prompt,
            max_tokens,
            cap,
            default,
            next(ids),
            variant,
            j,
            defaults,
            guide,
            adapter,
            priority,
        )
        for prompt in prompts
        for j in range(body.n)
    ]


def _check_log_probs(backend: Backend, model: ModelConfig, body: SamplingFields) -> None:
    """What the model's engine cannot answer is a 400 naming the field; logit_bias keys
    outside the vocabulary are a 400 naming each of them."""
    if body.wants_log_probs and not backend.serves_alternatives(model):
        field = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        if body.top_log_probs:
            raise APIError(
                f"model {model.id!r} returns the chosen tokens' log probabilities only (its "
                f"engine, TensorRT-LLM, has no alternatives): set {field} to 0",
                field,
            )
        if body.wants_prompt_log_probs:
            raise APIError(
                f"model {model.id!r} cannot return the prompt's log probabilities (echo "
                "with logprobs): its engine, TensorRT-LLM, does not compute them",
                "echo",
            )
    vocab = backend.vocab_size(model)
    outside = [repr(key) for key in body.logit_bias or {} if int(key) >= vocab]
    if outside:
        if len(outside) == 1:
            keys = f"key {outside[0]} is not a token id"
        else:
            keys = f"keys {', '.join(outside)} are not token ids"
        raise APIError(f"logit_bias {keys} of this model's vocabulary [0, {vocab})", "logit_bias")


@dataclass(frozen=True)
class ChatTurn:
    """A chat request's engine requests (one per choice) and how its answers are read."""

    model: ModelConfig
    params: list[GenerateParams]
    syntax: CallSyntax | None  # the model's call syntax (None: the answer is not read for calls)

    @property
    def served(self) -> str:
        """The model id the answer names (a pool's variant, an adapter)."""
        return served_id(self.model, self.params[0])

    def reading(self, keep_stop: bool = False) -> Reading:
        """How each choice's text is read: cut at the stop strings, calls taken out."""
        return Reading(self.params[0].stop, self.syntax, keep_stop)

    async def whole_answer(self, backend: Backend, log_probs: LogProbsOf | None = None) -> Answer:
        """The one choice's answer, whole (the Responses and Messages APIs ask for one)."""
        return await whole_answer(backend, self.model, self.params[0], self.reading(), log_probs)

    async def start_answer(self, backend: Backend) -> AnswerStream:
        """The one choice's answer, started."""
        return await start_answer(backend, self.model, self.params[0], self.reading())


async def guided(prepare: Callable[[], T], body: SamplingFields) -> T:
    """``prepare()``'s result, worked out on a thread where the request carries a guide:
    checking a guide not seen before (its JSON Schema, XGrammar's conversion) takes
    milliseconds, and longer for a large one, which the event loop relaying every other
    stream must not wait for. Requests without one are prepared here, without the hop."""
    if body.has_guide:
        return await asyncio.to_thread(prepare)
    return prepare()


def chat_turn(body: ChatCompletionRequest, request: Request, backend: Backend) -> ChatTurn:
    """The engine requests of a chat request, every API's (see the module's docstring)."""
    model, variant = _chat_target(body, request, backend)
    guide, syntax = _chat_guide(body, _call_syntax(model, body))
    prompt = _chat_prompt(body, model, backend)
    params = choices(request, body, model, variant, [prompt], body.requested_max_tokens, guide)
    return ChatTurn(model, params, syntax)


def count_prompt_tokens(body: ChatCompletionRequest, request: Request, backend: Backend) -> int:
    """How many tokens the model reads for a chat request: as many as the answer's
    usage would count as its input."""
    model, _ = _chat_target(body, request, backend)
    return backend.count_prompt_tokens(model, _chat_prompt(body, model, backend))


def _chat_target(
    body: ChatCompletionRequest, request: Request, backend: Backend
) -> tuple[ModelConfig, str | None]:
    """The model a chat request names (and its variant or adapter), within the caps."""
    model, entry = target(request, backend, body.model, "generate")
    if len(body.messages) > backend.config.max_messages:
        raise APIError(
            f"{len(body.messages)} messages, more than the cap of {backend.config.max_messages}",
            "messages",
        )
    check_prompt_chars(backend, sum(len(m.text) for m in body.messages), "messages")
    return model, entry


def _chat_prompt(body: ChatCompletionRequest, model: ModelConfig, backend: Backend) -> str:
    """The messages and the tools, rendered with the model's chat template."""
    messages = [m.template_message() for m in body.messages]
    return backend.chat_prompt(model, messages, body.template_tools())


def _call_syntax(model: ModelConfig, body: ChatCompletionRequest) -> CallSyntax | None:
    """How the model writes calls, where the answer may hold them."""
    if not body.calls_tools:
        return None
    if model.tool_call_parser is None:
        raise APIError(
            f"model {model.id!r} has no tool_call_parser configured, so its tool calls "
            "cannot be read (set tool_call_parser in its Serve config)",
            "tools",
        )
    return SYNTAXES[model.tool_call_parser]


def _chat_guide(
    body: ChatCompletionRequest, syntax: CallSyntax | None
) -> tuple[Guide | None, CallSyntax | None]:
    """The guide, and the call syntax the answer is read with (None: not read for calls):
    the output format's guide, or the tools' (which must be called when tool_choice is
    required or names one). With tool_choice auto and a response_format both, the format
    wins: the answer is the format, never a call; with a forced call, both cannot hold
    (a 400, as vLLM answers)."""
    output = body.output_guide()
    if syntax is None or (output is not None and body.tool_choice in (None, "auto")):
        return output, None
    if output is not None:  # a forced call, held to its tool's schema, or the format
        raise APIError(
            f"{output.param} cannot be combined with a forced tool call (tool_choice required "
            "or a named function): the call's arguments follow the tool's parameters; send "
            "tool_choice auto, or no structured output",
            "tool_choice",
        )
    parallel = body.parallel_tool_calls is not False
    return tool_guide(body.tools, body.tool_choice, parallel, syntax), syntax
