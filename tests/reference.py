"""transformers' own generate(), the reference the engine must equal."""

from __future__ import annotations

import torch


def hf_greedy(
    model,
    tokenizer,
    prompt: str,
    max_tokens: int,
    end_id: int | None = None,
    ignore_eos: bool = False,
):
    """Greedy continuation ids of ``prompt``, stopping at ``end_id`` (excluded), or
    ``max_tokens`` long whatever the end token with ``ignore_eos``."""
    ids = torch.tensor([tokenizer.encode(prompt)])
    eos = None if ignore_eos else tokenizer.eos_token_id if end_id is None else end_id
    with torch.inference_mode():
        out = model.generate(
            ids,
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )
    generated = out[0, ids.shape[1] :].tolist()
    if eos is not None and eos in generated:
        generated = generated[: generated.index(eos)]
    return generated


def counted(expected: list[int], max_tokens: int) -> int:
    """The generated-token count an engine reports for ``expected`` (``hf_greedy``'s
    ids): the end token counts too when it ended the answer (as vLLM counts it)."""
    return len(expected) + (len(expected) < max_tokens)
