"""The OpenAI request bodies this API accepts, and their GenerateParams.

``extra="forbid"``: a parameter we do not implement (``tools``,
``response_format``, ...) is a 400 naming it, never silently dropped.
Extensions users of this field send (top_k, repetition_penalty, min_tokens)
are accepted.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from serve.api.errors import APIError
from serve.generation import GenerateParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=2**64)
    user: str | None = None
    # Extensions (vLLM / TensorRT-LLM names).
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_words(cls, stop):
        words = [stop] if isinstance(stop, str) else (stop or [])
        if len(words) > 4 or any(not w for w in words):
            raise ValueError("stop takes up to 4 non-empty strings")
        return words

    def params(
        self,
        prompt: str,
        max_tokens: int | None,
        cap: int,
        default: int,
        request_id: str,
        variant: str | None = None,
    ) -> GenerateParams:
        max_tokens = max_tokens or default
        if max_tokens > cap:
            raise APIError(
                f"max_tokens {max_tokens} exceeds this server's cap of {cap}", param="max_tokens"
            )
        return GenerateParams(
            request_id=request_id,
            variant=variant,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens,
            stop=tuple(self.stop or ()),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str]  # a list gets one choice per prompt, in order
    logprobs: None = None  # not implemented: any value is a 400
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt):
        if isinstance(prompt, list) and not 1 <= len(prompt) <= 32:
            raise ValueError("a list prompt holds 1 to 32 strings (one choice each)")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] = False  # not implemented
    top_logprobs: None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str]  # token-id inputs are not supported: a 400 naming `input`
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None  # not supported (the model has one size)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _texts(cls, value):
        texts = [value] if isinstance(value, str) else value
        if not 1 <= len(texts) <= 2048 or not all(texts):
            raise ValueError("input holds 1 to 2048 non-empty strings (as OpenAI's API)")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class GenerateRequest(BaseModel):
    """The body of ``POST /generate``: a prompt and an optional token budget."""

    model_config = ConfigDict(extra="forbid")
    prompt: str
    max_new_tokens: int | None = Field(None, ge=1)
