"""``GenerateParams`` as vLLM ``SamplingParams`` keyword arguments (no vLLM import here:
the mapping is unit-tested in the project's environment, used in the vLLM one).

The same request must mean the same decoding on either engine: the API has already
resolved sampling into explicit parameters (:mod:`serve.api.sampling`: greedy is
``top_k=1``), which are translated here, not vLLM's defaults taken (vLLM would sample
at temperature 1); unset penalties stay neutral.
"""

from __future__ import annotations

from typing import Any

from serve.generation import GenerateParams


def sampling_kwargs(params: GenerateParams) -> dict[str, Any]:
    unset = params.temperature is None and not params.top_k and not params.top_p
    greedy = unset or params.temperature == 0 or params.top_k == 1
    kwargs: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": 0.0 if greedy else (params.temperature or 1.0),
        "top_p": params.top_p or 1.0,
        "top_k": 0 if greedy else params.top_k or 0,  # 0: the whole vocabulary
        "stop": list(params.stop),
        "ignore_eos": params.ignore_eos,
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
