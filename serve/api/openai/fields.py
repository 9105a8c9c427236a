"""The fields every OpenAI generating request shares (completions, chat; the Responses
and Messages requests become chat requests): the text type, sampling, stops, guides,
log probabilities, stream options, and their :class:`GenerateParams`."""

from __future__ import annotations

import random
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from serve.api.common.errors import APIError
from serve.api.common.sampling import GREEDY, SamplingDefaults, resolve
from serve.api.common.structured import (
    Guide,
    ResponseFormat,
    StructuredOutputs,
    guide_of,
)
from serve.generation import GenerateParams

# OpenAI's bound on top_logprobs (chat, Responses) and completions' logprobs, as vLLM
# takes it; the engines' contract allows as many (a unit test holds them together).
MAX_TOP_LOG_PROBS = 20


def _encodable(text: str) -> str:
    """JSON may carry a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer or
    wire format (UTF-8) can take: refused here, naming the field."""
    try:
        text.encode()
    except UnicodeEncodeError as error:
        raise ValueError(f"holds an unpaired surrogate at character {error.start}") from None
    return text


# Every text a request carries to the model or back.
Text = Annotated[str, AfterValidator(_encodable)]
MAX_CHOICES = 64  # prompts x n of one request: each is an engine request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk too


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=2**64)
    user: Text | None = None
    response_format: ResponseFormat | None = None
    # Token id (as a string, JSON's keys) -> bias added to its logit, OpenAI's range.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # Extensions (vLLM / TensorRT-LLM names).
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's: lower is admitted first by a full engine; the key's tenant's when absent.
    priority: int | None = Field(None, ge=-(2**31), lt=2**31)
    # vLLM's structured outputs, and their older names (serve/api/common/structured.py).
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: the engines use XGrammar

    @field_validator("stop")
    @classmethod
    def _stop_words(cls, stop):
        words = [stop] if isinstance(stop, str) else (stop or [])
        if len(words) > 4 or any(not w for w in words):
            raise ValueError("stop takes up to 4 non-empty strings")
        return words

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias):
        for key in bias or {}:
            if not key.strip().isdigit():
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer)")
        if bias and len(bias) > 300:  # OpenAI's own bound
            raise ValueError(f"{len(bias)} entries, more than 300")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def has_guide(self) -> bool:
        """Whether the request asks for constrained output (a structured-output field,
        or tools that may be called)."""
        formatted = self.response_format is not None and self.response_format.type != "text"
        tools = bool(getattr(self, "tools", None)) and getattr(self, "tool_choice", None) != "none"
        return (
            formatted
            or self.structured_outputs is not None
            or tools
            or any(value is not None for value in self._legacy_guides().values())
        )

    def output_guide(self) -> Guide | None:
        """The guide of the output format the request asks for (None: free text)."""
        return guide_of(self.response_format, self.structured_outputs, self._legacy_guides())

    def _legacy_guides(self) -> dict[str, Any]:
        """vLLM's older guide fields, by name."""
        return {
            "guided_json": self.guided_json,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar,
        }

    def params(
        self,
        prompt: str | list[int],
        max_tokens: int | None,
        cap: int,
        default: int,
        request_id: str,
        variant: str | None = None,
        choice: int = 0,
        defaults: SamplingDefaults = GREEDY,
        guide: Guide | None = None,
        adapter: str | None = None,
        priority: int = 0,
    ) -> GenerateParams:
        """The engine request of one choice; the ``choice``-th of n samples with its
        own seed (seed + choice), so n seeded choices differ and repeat."""
        max_tokens = max_tokens or default
        if max_tokens > cap:
            raise APIError(
                f"max_tokens {max_tokens} exceeds this server's cap of {cap}", param="max_tokens"
            )
        sampling = resolve(
            self.temperature, self.top_p, self.top_k, self.repetition_penalty, defaults
        )
        tokenized = not isinstance(prompt, str)
        return GenerateParams(
            request_id=request_id,
            variant=variant,
            adapter=adapter,
            prompt="" if tokenized else prompt,
            prompt_token_ids=tuple(prompt) if tokenized else (),
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=self._seed(choice),
            repetition_penalty=sampling.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
            return_log_probs=self.wants_log_probs,
            top_log_probs=self.top_log_probs,
            prompt_log_probs=self.wants_prompt_log_probs,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            guide_type=guide.type if guide else None,
            guide=guide.text if guide else "",
            guide_field=guide.param if guide else "",
            priority=priority,
        )

    def _seed(self, choice: int) -> int | None:
        """Choice ``choice``'s seed: the request's plus the choice's index; with no seed
        and n > 1, a random one per choice (TensorRT-LLM's default seed is the same for
        every request, which would make the n samples equal)."""
        if self.seed is not None:
            return (self.seed + choice) % 2**64
        return random.getrandbits(63) if self.n > 1 else None

    @property
    def wants_log_probs(self) -> bool:
        """The chosen tokens' log probabilities."""
        return False

    @property
    def top_log_probs(self) -> int:
        """The alternatives per token the answer lists."""
        return 0

    @property
    def wants_prompt_log_probs(self) -> bool:
        return False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats
