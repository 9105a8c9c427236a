"""Server-sent events and JSON bodies as every API dialect writes them: one event per
model (unset fields left out), kept on one line for any line reader, and a streamed
response that sends its closing events with the end of its body.
"""

from __future__ import annotations

import asyncio
import json

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

# SSE ends a line at \n or \r only, but clients that read a stream with str.splitlines
# (httpx's aiter_lines among them) also end one at U+0085, U+2028 and U+2029, which JSON
# leaves raw: a model's text holding one would cut its event in two there. Escaped, as
# json.dumps' ensure_ascii did; the other splitlines breaks are controls JSON escapes.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line(json_text: str) -> str:
    """``json_text`` with nothing any line reader takes for a line's end."""
    return json_text if json_text.isascii() else json_text.translate(_LINE_BREAKS)


def sse(event: BaseModel | dict | str) -> str:
    """An SSE event of a model (unset fields left out), an error body, or ``[DONE]``."""
    if isinstance(event, BaseModel):
        return f"data: {one_line(event.model_dump_json(exclude_unset=True))}\n\n"
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"


class LastEvents(str):
    """A stream's closing SSE events, sent with the end of its body (see :class:`EventStream`)."""


class EventStream(StreamingResponse):
    """An SSE response whose body iterator may end on :class:`LastEvents`: those go out
    in the same ASGI message as the end of the body, one write to the socket where
    Starlette's ``StreamingResponse`` makes two. Each ``send`` of a streamed response is
    a socket write that, on loopback to the HTTP front, runs the receiver's TCP work in
    the sender's time: under many streams uvicorn's ``send`` is the largest single entry
    of the replica's event loop. Starlette has no such option, hence this override of
    its ``stream_response``."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream in the request's own task while one task beside it waits for the
        client's disconnect, which cancels the stream (its generators' ``finally`` stop
        the engine). Starlette does the same under an anyio task group, whose cancel
        scope formats the task's repr on every cancel: a cost per request on the event
        loop that relays every stream, for one task and one cancel."""
        stream = asyncio.current_task()
        state = {"streaming": True, "client_left": False}

        async def watch() -> None:
            try:
                await self.listen_for_disconnect(receive)
            finally:  # the client left (or receive failed) while the stream was going
                if state["streaming"]:
                    state["client_left"] = True
                    stream.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state["client_left"]:
                raise
            # The client's leaving ends the response, as in Starlette; the cancel was
            # ours, so it is taken back (Task.uncancel: Python 3.11 on).
            if hasattr(stream, "uncancel"):
                stream.uncancel()
        finally:
            state["streaming"] = False  # before any await: the watcher cannot cancel now
            watcher.cancel()

    async def stream_response(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        ended = False
        async for events in self.body_iterator:
            ended = isinstance(events, LastEvents)
            body = events.encode(self.charset)
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def json_response(model: BaseModel) -> Response:
    """A whole answer, unset fields left out (see the module's docstring)."""
    return Response(model.model_dump_json(exclude_unset=True), media_type="application/json")
