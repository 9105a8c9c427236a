"""Prompt and word-list encoding used by the preprocessing model."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """A request the server refuses; the message is sent back to the client."""


def load_tokenizer(tokenizer_dir: str, tokenizer_class: str = ""):
    """Load a Hugging Face tokenizer from a local directory (never the hub).

    ``tokenizer_class`` (``module:Class``, what :func:`tokenizer_class_of` found when the
    repository was built) loads that class itself. AutoTokenizer's choice of a class
    imports torch (transformers' model configs do): 3 s of CPU in each process that
    only tokenizes, as Triton's pre- and postprocessing stubs do at every start. Empty:
    AutoTokenizer chooses."""
    if not tokenizer_class:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    module, _, name = tokenizer_class.partition(":")
    if not module.startswith("transformers.") or not name:
        raise ValueError(f"tokenizer_class {tokenizer_class!r}: not a transformers class")
    try:
        kind = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        # Another transformers than the one that built the repository: it chooses.
        log.warning("tokenizer class %s not in this transformers: AutoTokenizer", tokenizer_class)
        return load_tokenizer(tokenizer_dir)
    return kind.from_pretrained(tokenizer_dir, local_files_only=True)


def tokenizer_class_of(tokenizer_dir: str) -> str:
    """The class AutoTokenizer loads ``tokenizer_dir`` with, as :func:`load_tokenizer`
    takes it (``make engines`` writes it into the pre/postprocessing configs)."""
    kind = type(load_tokenizer(tokenizer_dir))
    return f"{kind.__module__}:{kind.__qualname__}"


@functools.lru_cache(maxsize=16)
def _rust_tokenizer(tokenizer):
    """The ``tokenizers.Tokenizer`` under ``tokenizer`` where calling it directly can give
    exactly what the tokenizer's own ``encode`` and ``decode`` give, else None.

    Every prompt and streamed chunk is encoded or decoded on the token path, and
    transformers' wrapper costs more than the Rust call it makes (one 30-token prompt:
    56 us against 40; a 5-token decode: 3.7 us against 1.0). Its class must keep
    transformers' own encode and decode, and decoding must clean up no spaces;
    :func:`encode` also checks, at each call, what the wrapper would reset (truncation,
    padding, the splitting of special tokens), since other callers may change it.
    """
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    passes_on = (
        isinstance(tokenizer, TokenizersBackend)
        and kind.encode is PreTrainedTokenizerBase.encode
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._encode_plus is TokenizersBackend._encode_plus
        and kind._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    return tokenizer.backend_tokenizer if passes_on else None


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text)``, through the Rust tokenizer where that is the same."""
    rust = _rust_tokenizer(tokenizer)
    if (
        rust is None
        or rust.truncation
        or rust.padding
        or rust.encode_special_tokens != bool(tokenizer.split_special_tokens)
    ):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return rust.encode(text, add_special_tokens=add_special_tokens).ids


def decode(tokenizer, ids: list[int], skip_special_tokens: bool) -> str:
    """``tokenizer.decode(ids)``, through the Rust tokenizer where that is the same."""
    rust = _rust_tokenizer(tokenizer)
    if rust is None:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return rust.decode(ids, skip_special_tokens=skip_special_tokens)


def encode_prompt(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``; BOS is added by the tokenizer's own post-processor."""
    ids = encode(tokenizer, text, add_special_tokens)
    if not ids:
        raise InvalidRequest("text_input is empty: the prompt must contain at least one token")
    return ids


def to_word_list(tokenizer, words: Sequence[str]) -> np.ndarray:
    """Encode words into TensorRT-LLM's ``[2, N]`` word-list form.

    Row 0 holds the concatenated token ids of all words, row 1 the cumulative end
    offset of each word; both are padded to the same length (ids with 0, offsets
    with -1). An empty list gives ``[[0], [-1]]``, which means "no words".
    """
    flat_ids: list[int] = []
    offsets: list[int] = []
    for word in words:
        if not word:
            continue
        ids = encode(tokenizer, word, add_special_tokens=False)
        if not ids:
            continue
        flat_ids.extend(ids)
        offsets.append(len(flat_ids))
    width = max(len(flat_ids), len(offsets), 1)
    out = np.zeros((2, width), dtype=np.int32)
    out[1, :] = -1
    out[0, : len(flat_ids)] = flat_ids
    out[1, : len(offsets)] = offsets
    return out


def from_word_list(word_list: np.ndarray | None) -> list[list[int]]:
    """Inverse of :func:`to_word_list`: the token-id sequence of each word."""
    if word_list is None:
        return []
    word_list = np.asarray(word_list)
    if word_list.ndim != 2 or word_list.shape[0] != 2:
        raise InvalidRequest(
            f"word list must have shape [2, N] (ids, offsets), got {list(word_list.shape)}"
        )
    ids, offsets = word_list[0], word_list[1]
    words: list[list[int]] = []
    start = 0
    for end in offsets:
        end = int(end)
        if end < 0:
            break
        if end <= start or end > len(ids):
            raise InvalidRequest(f"word list offsets are not increasing within [1, {len(ids)}]")
        words.append([int(t) for t in ids[start:end]])
        start = end
    return words


def decode_words(values: np.ndarray | None) -> list[str]:
    """STRING tensor values (bytes or str, any shape) as a flat list of words."""
    if values is None:
        return []
    out = []
    for value in np.asarray(values, dtype=object).reshape(-1):
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        if text:
            out.append(text)
    return out
