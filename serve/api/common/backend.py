"""What the HTTP routes need from the application, as one small interface.

The ingress deployment implements it over Serve's DeploymentHandles; the route
tests implement it over a fake (the routes, errors and shapes are what they test).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from serve.api.common.fairness import FairQueue
from serve.api.common.sampling import SamplingDefaults
from serve.api.common.token_texts import TokenTexts
from serve.config import AppConfig, ModelConfig
from serve.generation import GenerateParams, GenerationChunk

if TYPE_CHECKING:  # the Responses API's store: a dialect's, named here only as a type
    from serve.api.openai.responses.store import ResponseStore


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray  # [n, dim] float32, one row per input, in order
    num_tokens: int  # all inputs together


class Backend(Protocol):
    config: AppConfig
    response_store: ResponseStore | None  # None: the operator keeps no responses
    # The seats of each model's engines this process shares fairly between tenants
    # (serve/api/common/fairness.py); a model not in it, or an empty dict: fair shares off.
    fair_queues: dict[str, FairQueue]

    def chat_prompt(
        self, model: ModelConfig, messages: list[dict], tools: list[dict] | None = None
    ) -> str:
        """The messages (and the tools, OpenAI's shape) rendered with the model's chat
        template (one BOS)."""

    def count_prompt_tokens(self, model: ModelConfig, prompt: str) -> int:
        """How many tokens the model's engine reads for ``prompt``: its tokenizer's, with
        the special tokens the engine's tokenization adds (the answer's input tokens)."""

    def vocab_size(self, model: ModelConfig) -> int:
        """How many token ids the model's tokenizer knows (a token-id prompt's bound)."""

    def token_texts(self, model: ModelConfig) -> TokenTexts:
        """The model's tokens as text (a ``logprobs`` answer names its tokens and says
        where each starts)."""

    def serves_alternatives(self, model: ModelConfig) -> bool:
        """Whether the model's engine returns top-k alternatives and the prompt's log
        probabilities (the torch engine and vLLM; TensorRT-LLM does not)."""

    async def adapters(self, model: ModelConfig) -> list[str]:
        """The LoRA adapters found now in the directory of a model with ``lora``.
        Raises :class:`serve.api.common.errors.APIError`."""

    def takes_priority(self, model: ModelConfig) -> bool:
        """Whether the model's engine admits by a request's ``priority`` (the torch
        engine; not TensorRT-LLM's nor, as deployed here, vLLM's)."""

    def sampling_defaults(self, model: ModelConfig) -> SamplingDefaults:
        """The model's checkpoint's sampling defaults (``generation_config.json``)."""

    async def start(
        self, model: ModelConfig, params: GenerateParams
    ) -> tuple[GenerationChunk, AsyncIterator[GenerationChunk]]:
        """The first chunk (an error here is still an HTTP status) and the rest.
        Raises :class:`serve.api.common.errors.APIError`."""

    async def collect(
        self, model: ModelConfig, params: GenerateParams
    ) -> tuple[str, GenerationChunk]:
        """The whole answer and its last chunk (finish reason, token counts), whose
        ``token_ids``, ``token_log_probs`` and ``top_log_probs`` are the whole answer's (and
        ``prompt`` the first chunk's)."""

    async def embed(self, model: ModelConfig, texts: list[str]) -> Embeddings:
        """One vector per text."""

    def count_tenant_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        """Counts the tokens of one generation (or embeddings call) of a keyed request
        for its tenant (``/metrics``)."""

    async def not_ready(self) -> dict[str, str]:
        """The configured models that cannot answer now, each with the reason; empty
        when every model has a replica whose Triton reports it ready (``GET /health``)."""

    async def metrics_text(self) -> str:
        """The application's Prometheus text, every process's figures (``GET /metrics``).
        Raises :class:`serve.api.common.errors.APIError`."""
