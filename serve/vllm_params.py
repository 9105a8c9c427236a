"""``GenerateParams`` as vLLM ``SamplingParams`` keyword arguments (no vLLM import here:
the mapping is unit-tested in the project's environment, used in the vLLM one).

The same request must mean the same decoding on either engine, so Triton's
conventions (tritonllm/engine/sampling.py, after TensorRT-LLM) are translated, not
vLLM's defaults taken: a request that sets none of temperature, top_k and top_p is
greedy (vLLM would sample at temperature 1), and unset penalties stay neutral.
"""

from __future__ import annotations

from typing import Any

from serve.generation import GenerateParams


def sampling_kwargs(params: GenerateParams) -> dict[str, Any]:
    unset = params.temperature is None and not params.top_k and not params.top_p
    kwargs: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": 0.0
        if unset
        else (1.0 if params.temperature is None else params.temperature),
        "top_p": params.top_p or 1.0,
        "top_k": params.top_k or 0,  # 0: the whole vocabulary
        "stop": list(params.stop),
        # Triton's ensemble reports the cumulative log-probability when asked; vLLM
        # computes it once any logprobs are requested (0: the sampled token's only).
        "logprobs": 0 if params.return_log_probs else None,
    }
    optional = {
        "seed": params.seed,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "min_tokens": params.min_tokens,
    }
    return kwargs | {k: v for k, v in optional.items() if v is not None}
