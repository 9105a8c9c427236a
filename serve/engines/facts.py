"""What the API needs to know of a model's engine, whichever engine it is: each engine's
package answers for its own (``triton/facts.py``, ``vllm/facts.py``), in this shape."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineFacts:
    tokenizer: Any  # the one the engine itself uses, loaded as it loads it
    checkpoint: Path  # the tokenizer's folder: chat template, generation_config.json
    skips_special_tokens: bool  # an answer's text leaves special tokens out
    adds_special_tokens: bool  # a prompt is encoded with the tokenizer's (BOS)
    # The tensor contract's extensions of ours: top-k log probabilities, the prompt's,
    # the prefix cache's count, resuming a moved stream (the torch engine's).
    extensions: bool
    takes_priority: bool  # the engine admits by a request's priority
