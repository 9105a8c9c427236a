"""A Triton model's facts, from its repository: the preprocessing's tokenizer and
parameters, the postprocessing's, and what its engine step declares."""

from __future__ import annotations

from serve.config import ModelConfig
from serve.engines.facts import EngineFacts
from serve.engines.triton import repository


def triton_facts(model: ModelConfig, tokenizer=None) -> EngineFacts:
    repo, engine = model.triton.repository_path(), model.engine_model()
    return EngineFacts(
        tokenizer=tokenizer or repository.load_tokenizer(repo),
        checkpoint=repository.tokenizer_dir(repo),
        skips_special_tokens=repository.skips_special_tokens(repo),
        adds_special_tokens=repository.adds_special_tokens(repo),
        extensions=repository.serves_engine_extensions(repo, engine),
        takes_priority=repository.takes_priority(repo, engine),
    )
