"""What the API needs to know of a model's engine, whichever engine it is: each engine's
package answers for its own (``triton/facts.py``, ``vllm/facts.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve.config import ModelConfig


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


def engine_facts(model: ModelConfig, tokenizer=None) -> EngineFacts:
    """``model``'s engine's facts; ``tokenizer``: its tokenizer where this process has
    it loaded already (else it is loaded here, which takes seconds)."""
    if model.engine == "vllm":
        from serve.engines.vllm.facts import vllm_facts

        return vllm_facts(model, tokenizer)
    from serve.engines.triton.facts import triton_facts

    return triton_facts(model, tokenizer)
