"""The ensemble's tokenize and detokenize steps, run in the replica's own process.

Through the ensemble, every streamed response of the engine goes from Triton's core to
the postprocessing model's Python stub (a shared-memory round trip, a process switch)
and back before it reaches the replica. The replica holds the model's tokenizer
anyway, so it runs both steps itself, as vLLM's OpenAI server and TensorRT-LLM's
``trtllm-serve`` do in their API process: it tokenizes with the preprocessing's own
code and parameters (``tritonllm.preprocess``), sends the engine step its tensors, and
detokenizes each response incrementally (``tritonllm.detokenize``, the
postprocessing's detokenizer). Which tensor feeds which is read from the ensemble's
own ``ensemble_scheduling``, so a variant's ensemble goes the same way. The ensemble
stays in the repository, complete, for clients that call Triton directly
(``triton.pipeline: ensemble`` sends the replica's requests through it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serve.engines.triton import repository
from serve.engines.triton.requests import (
    AdapterInputs,
    ResponseReader,
    ensemble_inputs,
    ensemble_outputs,
)
from serve.generation import GenerateParams, GenerationError
from tritonllm import contract
from tritonllm.detokenize import IncrementalDetokenizer
from tritonllm.preprocess import ARGUMENTS, preprocess
from tritonllm.tokenization import InvalidRequest

# The preprocessing's and postprocessing's parameters (NVIDIA's names, ours alike).
_TOKENIZER_DIR, _ADD_SPECIAL, _SKIP_SPECIAL = (
    "tokenizer_dir",
    "add_special_tokens",
    "skip_special_tokens",
)


class StepsUnsupported(RuntimeError):
    """The ensemble is not the preprocessing -> engine -> postprocessing chain this
    module runs (the replica then sends its requests through the ensemble)."""


@dataclass(frozen=True)
class EnsembleSteps:
    """One ensemble's wiring, from its config: each step's inputs and outputs by the
    ensemble tensor they read or write."""

    engine: str  # the engine step's model (tensorrt_llm, or a variant's)
    preprocessing_inputs: dict[str, str]  # preprocessing input -> ensemble input
    preprocessing_outputs: dict[str, str]  # preprocessing output -> ensemble tensor
    engine_inputs: dict[str, str]  # engine input -> ensemble tensor
    engine_outputs: dict[str, str]  # engine output -> ensemble tensor


def read_steps(repository_dir: Path, ensemble: str) -> EnsembleSteps:
    config = repository.read_config(repository_dir, ensemble)
    steps = {step.model_name: step for step in config.ensemble_scheduling.step}
    engines = sorted(set(steps) - {contract.PREPROCESSING, contract.POSTPROCESSING})
    if len(steps) != 3 or len(engines) != 1:
        raise StepsUnsupported(f"{ensemble}'s steps are {sorted(steps)}")
    pre, engine = steps[contract.PREPROCESSING], steps[engines[0]]
    wiring = EnsembleSteps(
        engine=engines[0],
        preprocessing_inputs=dict(pre.input_map),
        preprocessing_outputs=dict(pre.output_map),
        engine_inputs=dict(engine.input_map),
        engine_outputs=dict(engine.output_map),
    )
    # A chunk reads the engine's outputs by the ensemble's names (serve/engines/triton/requests.py).
    renamed = {k: v for k, v in wiring.engine_outputs.items() if k != v and not v.startswith("_")}
    if renamed:
        raise StepsUnsupported(f"{ensemble} renames the engine's outputs {renamed}")
    unknown = set(wiring.preprocessing_inputs) - set(ARGUMENTS)
    if unknown:
        raise StepsUnsupported(f"{ensemble}'s preprocessing takes {sorted(unknown)}")
    return wiring


class ReplicaSteps:
    """:class:`serve.engines.triton.requests.Route` to the engine step, tokenizing and
    detokenizing in this process with the preprocessing's and postprocessing's own
    tokenizer and parameters."""

    def __init__(self, steps: EnsembleSteps, tokenizer, add_special: bool, skip_special: bool):
        self.steps = steps
        self.model = steps.engine
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special
        self.skip_special_tokens = skip_special
        # As the preprocessing model types its outputs.
        self._dtypes = {spec.name: spec.numpy_dtype for spec in contract.PREPROCESSING_OUTPUTS}
        self._outputs = frozenset(steps.engine_outputs.values())

    @classmethod
    def load(cls, repository_dir: Path, ensemble: str, tokenizer=None) -> ReplicaSteps:
        """The route for ``ensemble`` of the repository (its tokenizer loaded unless given)."""
        steps = read_steps(repository_dir, ensemble)
        pre = repository.read_config(repository_dir, contract.PREPROCESSING)
        post = repository.read_config(repository_dir, contract.POSTPROCESSING)
        if tokenizer is None:
            tokenizer = repository.load_tokenizer(repository_dir)
        return cls(
            steps,
            tokenizer,
            add_special=repository.flag(pre, _ADD_SPECIAL),
            skip_special=repository.flag(post, _SKIP_SPECIAL),
        )

    def inputs(
        self, params: GenerateParams, adapter: AdapterInputs | None = None
    ) -> dict[str, np.ndarray]:
        """The preprocessing's work, then the engine step's inputs as the ensemble feeds them."""
        given = ensemble_inputs(params, adapter)
        arguments = {
            ARGUMENTS[name]: given[source]
            for name, source in self.steps.preprocessing_inputs.items()
            if source in given
        }
        try:
            produced = preprocess(
                self.tokenizer, add_special_tokens=self.add_special_tokens, **arguments
            )
        except InvalidRequest as error:
            raise GenerationError(str(error), GenerationError.INVALID) from None
        for name, array in produced.items():
            given[self.steps.preprocessing_outputs[name]] = array.astype(
                self._dtypes[name], copy=False
            )
        return {
            name: given[source]
            for name, source in self.steps.engine_inputs.items()
            if source in given
        }

    def outputs(self, params: GenerateParams) -> tuple[str, ...]:
        return tuple(name for name in ensemble_outputs(params) if name in self._outputs)

    def reader(self, params: GenerateParams) -> ResponseReader:
        detokenizer = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
        return ResponseReader(params, detokenizer)
