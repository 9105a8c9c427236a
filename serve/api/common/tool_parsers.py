"""Tool calls out of a model's text, incrementally: the same parser reads a stream chunk
by chunk and a whole answer at once.

Each model family writes its calls in its own syntax; the parser is chosen per model in
the Serve config (``tool_call_parser``, vLLM's names):

- ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any
  number of them after optional text (Hermes, Qwen 2.5/3 and the default model);
- ``llama3_json``: ``{"name": "f", "parameters": {...}}`` (Llama 3.1+), optionally after
  ``<|python_tag|>``, several separated by ``;``.

XGrammar's structural tag for the same syntax (``xgrammar_format``) constrains what the
model writes when tools are given, so a call parses by construction; text that does not
parse (a model's own attempt without the constraint) stays plain content, never an error.

Written by hand: vLLM's parsers are the reference, but they live inside vLLM (which the
project's environment cannot import) and diff partial JSON re-parsed at every token. Here
one pass over each new character: the call's header is matched once, then its arguments
are streamed as they come, their end found by bracket depth outside JSON strings.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

# A JSON string (its text, escapes kept) in a call's header.
_NAME = r'"((?:[^"\\]|\\.)*)"'


@dataclass(frozen=True)
class CallSyntax:
    xgrammar_format: str  # xgrammar.get_model_structural_tag's model name
    trigger: str  # text that may open a call
    header: re.Pattern  # from the trigger up to the arguments' first character
    tail: re.Pattern  # after the arguments, to the end of the call
    opening: re.Pattern  # from the trigger to the call's JSON object
    close: str = ""  # the text that ends a call after its object, if any
    max_header: int = 4096  # characters before an unfinished header is plain text


SYNTAXES = {
    "hermes": CallSyntax(
        xgrammar_format="qwen_3",
        trigger="<tool_call>",
        header=re.compile(
            r'<tool_call>\s*\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"arguments"\s*:\s*'
        ),
        tail=re.compile(r"\s*\}\s*</tool_call>"),
        opening=re.compile(r"<tool_call>\s*"),
        close="</tool_call>",
    ),
    "llama3_json": CallSyntax(
        xgrammar_format="llama",
        trigger='{"name"',
        header=re.compile(
            r'\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*'
        ),
        tail=re.compile(r"\s*\}"),
        opening=re.compile(""),
    ),
}
_PYTHON_TAG = "<|python_tag|>"  # Llama's marker before a call: dropped


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_message(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class Delta:
    """What one piece of model text adds: content, new calls, argument pieces."""

    content: str = ""
    # (index, call id, name) of each call whose header completed in this piece
    started: list[tuple[int, str, str]] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)  # (call index, piece)

    def __bool__(self) -> bool:
        return bool(self.content or self.started or self.arguments)

    def tool_call_deltas(self) -> list[dict]:
        """OpenAI's ``delta.tool_calls``: id, type and name first, then argument pieces."""
        out = [
            {"index": i, "id": cid, "type": "function", "function": {"name": n, "arguments": ""}}
            for i, cid, n in self.started
        ]
        for index, piece in self.arguments:
            if out and out[-1]["index"] == index:  # same call: one fragment per event
                out[-1]["function"]["arguments"] += piece
            else:
                out.append({"index": index, "function": {"arguments": piece}})
        return out


class ToolCallParser:
    """Feed it the answer's text in order; it splits content from calls."""

    def __init__(self, syntax: CallSyntax):
        self._syntax = syntax
        self._state = "text"  # text | header | arguments | tail
        self._buffer = ""  # text not yet classified
        self._value_end = _ValueEnd()  # where the current call's arguments end
        self._after_call = False  # separators between calls are not content
        self.calls: list[ToolCall] = []
        self.content = ""

    def feed(self, text: str) -> Delta:
        self._buffer += text
        delta = Delta()
        while self._step(delta):
            pass
        self.content += delta.content
        return delta

    def finish(self) -> Delta:
        """The end of the answer: held-back text is content; an unfinished call's header
        (a length cut) becomes content too; an unfinished call's arguments stay as sent."""
        delta = Delta()
        if self._state in ("text", "header"):
            delta.content = self._buffer
        self._buffer = ""
        self.content += delta.content
        return delta

    # -- the states ------------------------------------------------------------------

    def _step(self, delta: Delta) -> bool:
        """Consume what can be classified; False when more text is needed."""
        return getattr(self, f"_{self._state}")(delta)

    def _text(self, delta: Delta) -> bool:
        trigger = self._syntax.trigger
        self._buffer = self._buffer.replace(_PYTHON_TAG, "")
        if self._after_call:
            self._buffer = self._buffer.lstrip(" \t\r\n;")
            if not self._buffer:
                return False
            self._after_call = False
        at = self._buffer.find(trigger)
        if at < 0:
            # Hold back a suffix that may be the start of a trigger (or of the tag).
            keep = _partial_suffix(self._buffer, (trigger, _PYTHON_TAG))
            cut = len(self._buffer) - keep
            delta.content += self._buffer[:cut]
            self._buffer = self._buffer[cut:]
            return False
        delta.content += self._buffer[:at]
        self._buffer = self._buffer[at:]
        self._state = "header"
        return True

    def _header(self, delta: Delta) -> bool:
        match = self._syntax.header.match(self._buffer)
        if match is not None:
            self._start_call(delta, json.loads(f'"{match.group(1)}"'))
            self._buffer = self._buffer[match.end() :]
            self._state, self._value_end = "arguments", _ValueEnd()
            return True
        # Not the usual header (other key order, other spacing, or no call at all):
        # once the JSON object after the trigger is complete, it decides.
        opening = self._syntax.opening.match(self._buffer)
        body = self._buffer[opening.end() :] if opening else ""
        too_long = len(self._buffer) > self._syntax.max_header
        if (body and not body.startswith("{")) or too_long:
            return self._not_a_call(delta)
        end = _ValueEnd().feed(body) if body else None
        if end is None:
            return False
        call = _as_call(body[:end])
        if call is None:
            return self._not_a_call(delta)
        self._start_call(delta, call[0])
        self.calls[-1].arguments = call[1]
        delta.arguments.append((len(self.calls) - 1, call[1]))
        self._buffer = "}" + self._buffer[opening.end() + end :]  # the tail expects it
        self._state = "tail"
        return True

    def _start_call(self, delta: Delta, name: str) -> None:
        call = ToolCall(new_call_id(), name)
        self.calls.append(call)
        delta.started.append((len(self.calls) - 1, call.id, name))

    def _not_a_call(self, delta: Delta) -> bool:
        """The trigger's text is content; the text after it is read again."""
        size = len(self._syntax.trigger)
        delta.content += self._buffer[:size]
        self._buffer = self._buffer[size:]
        self._state = "text"
        return True

    def _arguments(self, delta: Delta) -> bool:
        if not self.calls[-1].arguments:  # the value's leading whitespace is not part of it
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
        end = self._value_end.feed(self._buffer)
        piece = self._buffer if end is None else self._buffer[:end]
        if piece:
            self.calls[-1].arguments += piece
            delta.arguments.append((len(self.calls) - 1, piece))
        self._buffer = "" if end is None else self._buffer[end:]
        if end is None:
            return False
        self._state = "tail"
        return True

    def _tail(self, _delta: Delta) -> bool:
        match = self._syntax.tail.match(self._buffer)
        if match is None and _tail_may_complete(self._buffer, self._syntax):
            return False  # more of the close may come (finish() drops an unfinished one)
        if match is not None:
            self._buffer = self._buffer[match.end() :]
        self._state, self._after_call = "text", True
        return True


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of ``text`` that begins one of ``markers``."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-size:]):
                best = max(best, size)
                break
    return best


def _tail_may_complete(buffer: str, syntax: CallSyntax) -> bool:
    """Whitespace, the closing brace and a prefix of the close: more may come."""
    stripped = buffer.lstrip()
    if not stripped:
        return True
    rest = stripped[1:].lstrip()
    return stripped[0] == "}" and bool(syntax.close) and syntax.close.startswith(rest)


class _ValueEnd:
    """Finds where one JSON value ends in text fed piece by piece: bracket depth and
    string state carry across pieces."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> int | None:
        """The value's end in ``text`` (an index past it), or None: not yet."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1  # a bare string
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif self.depth == 0 and char in ",}\n" and i:
                return i  # a bare scalar (a number, true): ends before its delimiter
        return None


def _as_call(text: str) -> tuple[str, str] | None:
    """A call's name and arguments (JSON text) from a whole call object, if it is one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def parse_whole(syntax: CallSyntax, text: str) -> tuple[str, list[ToolCall]]:
    """An unstreamed answer: its content and its calls; an answer with a call whose
    arguments do not parse (cut by max_tokens) is all content."""
    parser = ToolCallParser(syntax)
    parser.feed(text)
    parser.finish()
    for call in parser.calls:
        try:
            json.loads(call.arguments)
        except ValueError:
            return text, []
    return parser.content, parser.calls
