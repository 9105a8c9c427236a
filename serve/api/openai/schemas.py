"""The OpenAI request bodies this API accepts, and their GenerateParams.

``extra="forbid"``: a parameter we do not implement (``functions``, ...) is a 400
naming it, never silently dropped. vLLM's sampling extensions that clients and
load tools send (top_k, repetition_penalty, min_tokens, ignore_eos,
include_stop_str_in_output, stream_options.continuous_usage_stats) and its
structured-output fields (``structured_outputs``, ``guided_*``) are accepted.
"""

from __future__ import annotations

import json
import random
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from serve.api.common.errors import APIError
from serve.api.common.sampling import GREEDY, SamplingDefaults, resolve
from serve.api.common.structured import (
    ChatTool,
    Guide,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    ToolChoice,
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


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    # A list gets n choices per prompt, in order; token ids are a prompt the client
    # tokenized itself (one list, or a list of them), taken as they are.
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    # 0 with echo: the prompt alone, scored (the route refuses it without echo).
    max_tokens: int | None = Field(None, ge=0)
    # The chosen tokens' log probabilities and this many alternatives (0: none).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOG_PROBS)
    echo: bool = False  # the prompt's text (with logprobs: its tokens' too) before the answer

    @property
    def wants_log_probs(self) -> bool:
        return self.logprobs is not None

    @property
    def top_log_probs(self) -> int:
        return self.logprobs or 0

    @property
    def wants_prompt_log_probs(self) -> bool:
        return self.echo and self.logprobs is not None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt):
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return prompt
        if not 1 <= len(prompt) <= 32:
            raise ValueError("a list of prompts holds 1 to 32 prompts (one choice each)")
        return prompt

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """Each prompt: a text, or the token ids of one."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)


class TextPart(BaseModel):
    """A content part: only text reaches a text model; any other ``type`` (image_url,
    input_audio, file) is a 400 naming the part."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text
    arguments: Text  # JSON text, as the model wrote it


class ToolCallParam(BaseModel):
    """A call an assistant message made (sent back with the conversation)."""

    model_config = ConfigDict(extra="forbid")
    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction

    def template_call(self) -> dict:
        """As chat templates read it: the arguments as an object where they parse (as
        vLLM passes them; templates write them with ``tojson``)."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # "developer" is OpenAI's name for the system role of its current models.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages: the call answered
    # What the SDKs send back with an assistant message they received: nothing to read.
    refusal: Text | None = None
    annotations: list | None = None
    function_call: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        # Before the union is tried, so the client reads this, not two union errors.
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(
                        f"content part {i} has type {kind!r}: only text parts are "
                        "supported (the model reads text only)"
                    )
        return content

    @model_validator(mode="after")
    def _fields_of_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed in assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the call it answers)")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (except in an assistant message with tool_calls)")
        return self

    @property
    def text(self) -> str:
        """The content as one text (parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_message(self) -> dict:
        """What the chat template reads: plain text, developer as system, calls."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.text}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOG_PROBS)
    tools: list[ChatTool] | None = Field(None, min_length=1, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return self

    @field_validator("messages")
    @classmethod
    def _results_answer_calls(cls, messages):
        """A tool result answers a call an earlier assistant message made, as OpenAI and
        Anthropic require (a result for a call nobody made is a client's mistake, or a
        made-up conversation)."""
        made = set()
        for message in messages:
            made.update(call.id for call in message.tool_calls or ())
            if message.role == "tool" and message.tool_call_id not in made:
                raise ValueError(
                    f"the tool result for call {message.tool_call_id!r} answers no call made "
                    "earlier in the conversation"
                )
        return messages

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice, info: ValidationInfo):
        tools = info.data.get("tools") or []
        if choice not in (None, "none") and not tools:
            raise ValueError("tool_choice is only allowed when tools are given")
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in {tool.function.name for tool in tools}:
                raise ValueError(f"names {name!r}, which is not one of the tools")
        return choice

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (and so is parsed for them)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template reads them (OpenAI's shape)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def wants_log_probs(self) -> bool:
        return self.logprobs

    @property
    def top_log_probs(self) -> int:
        return self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text
    input: Text | list[Text]  # token-id inputs are not supported: a 400 naming `input`
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None  # not supported (the model has one size)
    user: Text | None = None

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
    prompt: Text
    max_new_tokens: int | None = Field(None, ge=1)
