"""Incremental detokenization for streamed generation.

Decoding each streamed chunk on its own (what upstream's postprocessing does)
breaks two things: a multi-byte character split across tokens comes out as
U+FFFD pieces, and tokenizers whose decoder strips the word-initial space of the
first token (SentencePiece's Metaspace) glue words together. The offset method
used by Hugging Face TGI fixes both: decode a short window of earlier tokens
together with the new ones and emit only the text past the window, holding text
back while it ends in an incomplete character. The concatenation of the emitted
pieces then equals ``tokenizer.decode(all_tokens)``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from tritonllm import tokenization

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas (TGI's prefix/read offsets)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, tokens: list[int]) -> str:
        return tokenization.decode(self._tokenizer, tokens, self._skip_special_tokens)

    def add(self, new_tokens: Iterable[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self._tokens.extend(int(t) for t in new_tokens)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_INCOMPLETE):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            return new_text[len(prefix_text) :]
        return ""


class StreamDetokenizers:
    """One :class:`IncrementalDetokenizer` per streamed request, keyed by request id.

    In an ensemble each streamed response of ``tensorrt_llm`` reaches the
    postprocessing as a separate request carrying only the new tokens, but with
    the client's request id (Triton copies it to every step). The postprocessing
    never sees the end of a stream, so entries are dropped least-recently-used
    past ``max_entries`` and after ``idle_timeout_s`` without a chunk. Requests
    need ids unique among those in flight; the Serve app always sends a fresh one.
    """

    def __init__(self, tokenizer, max_entries: int = 4096, idle_timeout_s: float = 300.0):
        self._tokenizer = tokenizer
        self._max_entries = max_entries
        self._idle_timeout_s = idle_timeout_s
        self._entries: OrderedDict[str, tuple[float, IncrementalDetokenizer]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, new_tokens: Iterable[int]) -> str:
        now = time.monotonic()
        self._expire(now)
        entry = self._entries.pop(request_id, None)
        detok = entry[1] if entry else IncrementalDetokenizer(self._tokenizer)
        self._entries[request_id] = (now, detok)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return detok.add(new_tokens)

    def _expire(self, now: float) -> None:
        while self._entries:
            oldest_id, (last_seen, _) = next(iter(self._entries.items()))
            if now - last_seen < self._idle_timeout_s:
                return
            del self._entries[oldest_id]
