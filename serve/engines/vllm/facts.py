"""A vLLM model's facts: its checkpoint's tokenizer, vLLM's defaults, and none of the
torch engine's extensions (nor priorities: it is deployed without its priority
scheduling)."""

from __future__ import annotations

from serve.config import ModelConfig
from serve.engines.facts import EngineFacts
from tritonllm import tokenization


def vllm_facts(model: ModelConfig, tokenizer=None) -> EngineFacts:
    checkpoint = model.vllm.checkpoint_path()
    return EngineFacts(
        tokenizer=tokenizer or tokenization.load_tokenizer(str(checkpoint)),
        checkpoint=checkpoint,
        skips_special_tokens=True,
        adds_special_tokens=True,
        extensions=False,
        takes_priority=False,
    )
