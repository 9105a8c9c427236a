"""The response object of one turn, from ``in_progress`` to its end, its output items,
and its record in the response store."""

from __future__ import annotations

import time
import uuid

from serve.api.common.answer import Answer
from serve.api.common.errors import APIError, TooLarge
from serve.api.openai.prepare import ChatTurn
from serve.api.openai.responses.schemas import ResponsesRequest
from serve.api.openai.responses.shapes import (
    IncompleteDetails,
    Response,
    ResponseError,
    ResponseFunctionToolCall,
    ResponseOutputItem,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseUsage,
)
from serve.api.openai.responses.store import RecordTooLarge, ResponseStore


class Draft:
    """The response object of one turn, from ``in_progress`` to its end."""

    def __init__(self, body: ResponsesRequest, turn: ChatTurn, stored: bool):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.stored = stored
        self._created = int(time.time())
        self._body, self._turn = body, turn

    @property
    def input_count(self) -> int:
        """How many items this turn's request sent (``input_items`` lists them)."""
        return len(self._body.items)

    def snapshot(self, status: str, output: list[ResponseOutputItem], **fields) -> Response:
        body, params = self._body, self._turn.params[0]
        text_format = body.text.format if body.text else None
        choice = body.tool_choice
        echoed = {
            "id": self.id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self._turn.served,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": self.stored,
            "temperature": params.temperature,
            "text": {"format": _dumped(text_format) or {"type": "text"}},
            "tool_choice": _dumped(choice) or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "top_p": params.top_p,
            "top_logprobs": body.top_logprobs,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
        }
        return Response(**{**echoed, **fields})

    def finished(self, answer: Answer, output: list[ResponseOutputItem]) -> Response:
        """The response once ``answer`` is whole: completed, or incomplete where the
        token budget cut it."""
        cut = answer.finish_reason == "length"
        for item in output:
            item.status = "incomplete" if cut else "completed"
        return self.snapshot(
            "incomplete" if cut else "completed",
            output,
            completed_at=None if cut else int(time.time()),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
            usage=_usage(answer),
        )

    def failed(self, error: APIError, output: list[ResponseOutputItem]) -> Response:
        code = error.code or ("server_error" if error.status >= 500 else "invalid_request")
        failure = ResponseError(code=code, message=error.message)
        return self.snapshot("failed", output, error=failure)


def _dumped(value):
    """A request's model as the response echoes it (a plain value as it is)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(by_alias=True, exclude_none=True)
    return value


def _usage(answer: Answer) -> ResponseUsage:
    prompt, completion, cached = answer.usage
    return ResponseUsage(
        input_tokens=prompt,
        input_tokens_details={"cached_tokens": cached},
        output_tokens=completion,
        output_tokens_details={"reasoning_tokens": 0},
        total_tokens=prompt + completion,
    )


def text_part(text: str = "", log_probs: list | None = None) -> ResponseOutputText:
    """Output text; ``logprobs`` lists its tokens' where the request included them."""
    return ResponseOutputText(
        type="output_text", text=text, annotations=[], logprobs=log_probs or []
    )


def message_item(text: str = "", log_probs: list | None = None) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=f"msg_{uuid.uuid4().hex}",
        type="message",
        status="in_progress",
        role="assistant",
        content=[text_part(text, log_probs)],
    )


def call_item(call_id: str, name: str, arguments: str = "") -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        id=f"fc_{uuid.uuid4().hex}",
        type="function_call",
        status="in_progress",
        call_id=call_id,
        name=name,
        arguments=arguments,
    )


def output_items(answer: Answer) -> list[ResponseOutputItem]:
    """A whole answer's output: its text (where it wrote any, or called nothing), then
    its calls."""
    wrote = answer.content or not answer.calls
    text = [message_item(answer.content, answer.log_probs)] if wrote else []
    return text + [call_item(call.id, call.name, call.arguments) for call in answer.calls]


async def save(
    store: ResponseStore | None, draft: Draft, response: Response, history: list[dict]
) -> None:
    if draft.stored:
        stored = response.model_dump(exclude_unset=True)  # as it went on the wire
        record = {
            "response": stored,
            "conversation": history + stored["output"],
            "input_count": draft.input_count,
        }
        try:
            await store.put(draft.id, record)
        except RecordTooLarge as error:
            raise TooLarge(f"{error}; send store: false", "store") from None
