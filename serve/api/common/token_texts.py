"""What a ``logprobs`` answer says of its tokens, from the model's tokenizer: each
token's own text, a token-id prompt as text, and where each token starts in the
answer's text (completions' ``text_offset``).

An offset is measured the way the text was made: the answer's text is the engine's
incremental detokenization of its tokens, so an :class:`IncrementalDetokenizer` fed
the same tokens here tells how much text each one adds. A token that adds none (a
skipped special token, the end token, the first bytes of a character) points at the
next character: where it stands in the text. Summing each token's own text instead
(vLLM's way) drifts by every special token and split character before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tritonllm import tokenization
from tritonllm.detokenize import IncrementalDetokenizer


class TokenTexts:
    """One model's tokens as text. ``skip_special_tokens``: whether its answers' text
    leaves special tokens out (the postprocessing's parameter, vLLM's default)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.end_id: int | None = tokenizer.eos_token_id  # the engines' end token

    def texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text, a special token by its name (``</s>``)."""
        return [tokenization.decode(self._tokenizer, [token], False) for token in token_ids]

    def prompt_text(self, token_ids: Sequence[int]) -> str:
        """A token-id prompt as text, special tokens included (what an echo returns)."""
        return tokenization.decode(self._tokenizer, list(token_ids), False)

    def prompt_offsets(self, token_ids: Sequence[int], echoed: str) -> list[int]:
        """Where each prompt token starts in ``echoed``, the prompt's text as the answer
        echoes it: the client's own text, or :meth:`prompt_text`. Special tokens the
        tokenizer added (a BOS) are not in the client's text: measured on the prompt's
        decoding with its special tokens, which ends with ``echoed``, they point at its
        start."""
        offsets = AnswerOffsets(self._tokenizer, False, 0)
        starts = offsets.add(token_ids)
        added = offsets.position - len(echoed)
        return [min(max(start - added, 0), len(echoed)) for start in starts]

    def answer_offsets(self, start: int) -> AnswerOffsets:
        """The offsets of an answer's tokens, whose text starts at ``start`` (after the
        echoed prompt)."""
        return AnswerOffsets(self._tokenizer, self.skip_special_tokens, start)


class AnswerOffsets:
    """Where each of an answer's tokens starts, chunk by chunk."""

    def __init__(self, tokenizer, skip_special_tokens: bool, start: int):
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.position = start  # the text's length so far

    def add(self, token_ids: Sequence[int]) -> list[int]:
        starts = []
        for token in token_ids:
            starts.append(self.position)
            self.position += len(self._detokenizer.add([token]))
        return starts
