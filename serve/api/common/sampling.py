"""One sampling behaviour whatever the engine: a request's sampling fields, with the
checkpoint's defaults, resolved into explicit engine parameters.

The engines disagree on what an unset field means (TensorRT-LLM stays greedy when
only a temperature is set, the torch engine samples), so the API never leaves the
choice to them: a greedy request goes out as ``top_k=1``, a sampled one with its
temperature, top-p and top-k all set.

The rule: a request samples when it sets a temperature above 0, a top-p below 1 or a
top-k above 1; a request that sets none of them follows the checkpoint's
``generation_config.json`` as transformers reads it (``do_sample`` with its
``temperature``/``top_p``/``top_k``; absent, greedy). vLLM differs for checkpoints
whose config says nothing (it samples at temperature 1).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class SamplingDefaults:
    """What the checkpoint's ``generation_config.json`` asks for when a request is silent."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    repetition_penalty: float | None = None

    @classmethod
    def from_checkpoint(cls, directory: Path | str) -> SamplingDefaults:
        path = Path(directory) / "generation_config.json"
        if not path.is_file():
            return cls()
        config = json.loads(path.read_text())
        # Only the keys the file sets (as vLLM reads it): transformers' own defaults
        # (top_k 50) are not the checkpoint's choice.
        known = {"do_sample", "temperature", "top_p", "top_k", "repetition_penalty"}
        values = {k: v for k, v in config.items() if k in known and v is not None}
        log.info("sampling defaults from %s: %s", path, values or "none (greedy)")
        return cls(**values)


GREEDY = SamplingDefaults()


@dataclass(frozen=True)
class ResolvedSampling:
    temperature: float | None
    top_p: float | None
    top_k: int
    repetition_penalty: float | None


def resolve(
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    repetition_penalty: float | None,
    defaults: SamplingDefaults = GREEDY,
) -> ResolvedSampling:
    asks_to_sample = (
        (temperature is not None and temperature > 0)
        or (top_p is not None and top_p < 1)
        or (top_k is not None and top_k > 1)
    )
    silent = temperature is None and top_p is None and top_k is None
    samples = asks_to_sample or (silent and defaults.do_sample)
    if temperature == 0 or top_k == 1 or not samples:
        return ResolvedSampling(None, None, 1, repetition_penalty or defaults.repetition_penalty)
    return ResolvedSampling(
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        repetition_penalty=repetition_penalty or defaults.repetition_penalty,
    )
