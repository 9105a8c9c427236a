"""Chat messages to the prompt text the ensemble's preprocessing tokenizes."""

from __future__ import annotations


def render_chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The tokenizer's chat template with the generation prompt, without a leading BOS:
    preprocessing encodes with special tokens and adds BOS itself, so a template that
    writes it too would give the model two. ``tools`` (OpenAI's shape) go to the template
    as ``tools``, which templates that know tools list for the model."""
    prompt = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    bos = tokenizer.bos_token
    return prompt[len(bos) :] if bos and prompt.startswith(bos) else prompt
