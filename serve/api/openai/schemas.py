"""The OpenAI request bodies this API accepts (their shared fields, and how they
become GenerateParams: fields.py).

``extra="forbid"``: a parameter we do not implement (``functions``, ...) is a 400
naming it, never silently dropped. vLLM's sampling extensions that clients and
load tools send (top_k, repetition_penalty, min_tokens, ignore_eos,
include_stop_str_in_output, stream_options.continuous_usage_stats) and its
structured-output fields (``structured_outputs``, ``guided_*``) are accepted.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from serve.api.common.structured import ChatTool, NamedToolChoice, ToolChoice, check_tool_choice
from serve.api.common.unsupported import outsider
from serve.api.openai.fields import MAX_TOP_LOG_PROBS, SamplingFields, Text

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
        if found := outsider(content, ("text",)):
            raise ValueError(
                f"content part {found[0]} has type {found[1]!r}: only text parts are "
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
        tools = {tool.function.name for tool in info.data.get("tools") or []}
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        check_tool_choice(choice not in (None, "none"), named, tools)
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
