"""Stop strings cut from the answer, as OpenAI returns it.

The engines stop on a stop word's tokens and, as TensorRT-LLM does, keep it in the
output; OpenAI's API and vLLM return the text before it. Matching on the text here
also catches a stop string the model spelled with other tokens than the stop word's
own tokenization (the engine then does not stop by itself: the caller closes the
stream). Written by hand: this is the API's own text rule, no library has it.
"""

from __future__ import annotations


class StopStringCutter:
    """Feeds an answer's text through, releasing only what cannot become a stop string.

    A streamed tail that may still be the start of a stop string is held back until the
    next text decides; nothing after a stop string is ever released.
    """

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        self._stops = stops
        self._include_stop = include_stop
        self._held = ""
        self.stop: str | None = None  # the stop string found, once one is

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def feed(self, text: str) -> str:
        """The part of ``held + text`` that is final; sets ``stop`` at a stop string."""
        buffer = self._held + text
        found = [(buffer.find(s), s) for s in self._stops]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, stop = min(found)
            self.stop, self._held = stop, ""
            return buffer[: at + len(stop)] if self._include_stop else buffer[:at]
        keep = self._undecided_tail(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The held tail, once the answer has ended without completing a stop string."""
        held, self._held = self._held, ""
        return held

    def _undecided_tail(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that starts some stop string."""
        longest = max(map(len, self._stops), default=0)
        for length in range(min(len(buffer), longest - 1), 0, -1):
            tail = buffer[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0
