"""The response of OpenAI's Responses API and its stream's events, named as the openai
SDK names them, dumped with ``exclude_unset`` (serve/api/openai/shapes.py's rule): a
field without a default is always sent, ``null`` when None; one with a default only
when given. So a ``type`` is given."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
)


class ResponseOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list
    logprobs: list


class ResponseOutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseFunctionToolCall(BaseModel):
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


ResponseOutputItem = Annotated[
    ResponseOutputMessage | ResponseFunctionToolCall, Field(discriminator="type")
]


class InputTokensDetails(BaseModel):
    cached_tokens: int  # read from the engine's prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """The response object, from ``in_progress`` to its end; what the request set is
    echoed as the client sent it (``text``, ``tool_choice``, ``tools``)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    model: str
    output: list[ResponseOutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, None]
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    top_logprobs: int | None
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    completed_at: int | None = None  # once finished: null where the answer was cut


# -- the stream --------------------------------------------------------------------------


class StreamEvent(BaseModel):
    """Every event names its type (the SSE ``event:`` too) and its place in the stream."""

    type: str
    sequence_number: int


class _ResponseEvent(StreamEvent):
    response: Response


class ResponseCreatedEvent(_ResponseEvent):
    type: Literal["response.created"]


class ResponseInProgressEvent(_ResponseEvent):
    type: Literal["response.in_progress"]


class ResponseCompletedEvent(_ResponseEvent):
    type: Literal["response.completed"]


class ResponseIncompleteEvent(_ResponseEvent):
    type: Literal["response.incomplete"]


class ResponseFailedEvent(_ResponseEvent):
    type: Literal["response.failed"]


class ResponseOutputItemAddedEvent(StreamEvent):
    type: Literal["response.output_item.added"]
    output_index: int
    item: ResponseOutputItem


class ResponseOutputItemDoneEvent(StreamEvent):
    type: Literal["response.output_item.done"]
    output_index: int
    item: ResponseOutputItem


class _ItemEvent(StreamEvent):
    """An event about the content of one item."""

    item_id: str
    output_index: int


class ResponseContentPartAddedEvent(_ItemEvent):
    type: Literal["response.content_part.added"]
    content_index: int
    part: ResponseOutputText


class ResponseContentPartDoneEvent(_ItemEvent):
    type: Literal["response.content_part.done"]
    content_index: int
    part: ResponseOutputText


class ResponseTextDeltaEvent(_ItemEvent):
    type: Literal["response.output_text.delta"]
    content_index: int
    delta: str
    logprobs: list


class ResponseTextDoneEvent(_ItemEvent):
    type: Literal["response.output_text.done"]
    content_index: int
    text: str
    logprobs: list


class ResponseFunctionCallArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"]
    delta: str


class ResponseFunctionCallArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"]
    name: str
    arguments: str


ResponseStreamEvent = Annotated[
    ResponseCreatedEvent
    | ResponseInProgressEvent
    | ResponseCompletedEvent
    | ResponseIncompleteEvent
    | ResponseFailedEvent
    | ResponseOutputItemAddedEvent
    | ResponseOutputItemDoneEvent
    | ResponseContentPartAddedEvent
    | ResponseContentPartDoneEvent
    | ResponseTextDeltaEvent
    | ResponseTextDoneEvent
    | ResponseFunctionCallArgumentsDeltaEvent
    | ResponseFunctionCallArgumentsDoneEvent,
    Field(discriminator="type"),
]
