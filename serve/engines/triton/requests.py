"""The codec of the Triton boundary: a request's ensemble tensors from its
:class:`GenerateParams`, and a :class:`GenerationChunk` from each ensemble response.

Both hosts (in-process and sidecar) use it; the mapping to and from the ensemble's
tensors (``tritonllm.contract``) lives here and nowhere above the replica.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from serve.generation import GenerateParams, GenerationChunk, PromptLogProbs, TopLogProbs
from tritonllm import contract
from tritonllm.detokenize import IncrementalDetokenizer
from tritonllm.lora import LoraTensors

_NO_IDS = np.empty(0, dtype=np.int32)

# GenerateParams' optional sampling fields, each named as its ensemble input.
_OPTIONAL_SCALARS = (
    contract.TEMPERATURE,
    contract.TOP_P,
    contract.TOP_K,
    contract.SEED,
    contract.REPETITION_PENALTY,
    contract.PRESENCE_PENALTY,
    contract.FREQUENCY_PENALTY,
    contract.MIN_TOKENS,
)


def _put(values: dict[str, np.ndarray], spec: contract.Tensor, *items) -> None:
    """``items`` as ``spec``'s [1, len(items)] tensor (texts encoded), under its name."""
    if spec.triton_dtype == "TYPE_STRING":
        values[spec.name] = np.array([[item.encode() for item in items]], dtype=object)
    else:
        values[spec.name] = np.array([items], dtype=spec.numpy_dtype)


@dataclasses.dataclass(frozen=True)
class AdapterInputs:
    """A LoRA adapter as the engine takes it: its task id, and its weights where the
    engine may not hold them yet (TensorRT-LLM takes them once; docs/lora.md)."""

    task_id: int
    tensors: LoraTensors | None = dataclasses.field(default=None, compare=False, repr=False)


def ensemble_inputs(
    params: GenerateParams, adapter: AdapterInputs | None = None
) -> dict[str, np.ndarray]:
    """The ensemble's input tensors (batch 1, streamed, prompt excluded from the output),
    with ``adapter``'s where the request is for one."""
    values: dict[str, np.ndarray] = {}
    _put(values, contract.TEXT_INPUT, params.prompt)
    _put(values, contract.MAX_TOKENS, params.max_tokens)
    _put(values, contract.STREAM, True)
    _put(values, contract.EXCLUDE_INPUT_IN_OUTPUT, True)
    _put(values, contract.RETURN_NUM_INPUT_TOKENS, True)
    _put(values, contract.RETURN_NUM_OUTPUT_TOKENS, True)
    _put(values, contract.RETURN_LOG_PROBS, params.return_log_probs)
    for spec in _OPTIONAL_SCALARS:
        value = getattr(params, spec.name)
        if value is not None:
            _put(values, spec, value)
    if params.prompt_token_ids:
        _put(values, contract.INPUT_IDS, *params.prompt_token_ids)
    if params.resumed_tokens:
        _put(values, contract.RESUMED_OUTPUT_LEN, params.resumed_tokens)
    if params.priority:
        _put(values, contract.PRIORITY, params.priority)
    if params.ignore_eos:  # TensorRT-LLM's "no end id"
        _put(values, contract.END_ID, -1)
    if params.stop:
        _put(values, contract.STOP_WORDS, *params.stop)
    if params.top_log_probs:
        _put(values, contract.NUM_TOP_LOG_PROBS, params.top_log_probs)
    if params.prompt_log_probs:
        _put(values, contract.RETURN_PROMPT_LOG_PROBS, True)
    if params.guide_type:  # TensorRT-LLM's guided decoding (XGrammar)
        _put(values, contract.GUIDED_DECODING_GUIDE_TYPE, params.guide_type)
        _put(values, contract.GUIDED_DECODING_GUIDE, params.guide)
    if params.logit_bias:
        ids, weights = zip(*params.logit_bias, strict=True)
        _put(values, contract.EMBEDDING_BIAS_TOKEN_IDS, *ids)
        _put(values, contract.EMBEDDING_BIAS_WEIGHTS, *weights)
    return values if adapter is None else values | _lora_inputs(adapter)


def _lora_inputs(adapter: AdapterInputs) -> dict[str, np.ndarray]:
    """TensorRT-LLM's LoRA inputs: the task id, and the weights when the replica sends
    them (the engine's first use of the adapter)."""
    values: dict[str, np.ndarray] = {}
    _put(values, contract.LORA_TASK_ID, adapter.task_id)
    if adapter.tensors is not None:
        weights, config = adapter.tensors.weights, adapter.tensors.config
        values[contract.LORA_WEIGHTS.name] = weights.astype(contract.LORA_WEIGHTS.numpy_dtype)[None]
        values[contract.LORA_CONFIG.name] = config.astype(contract.LORA_CONFIG.numpy_dtype)[None]
    return values


def ensemble_outputs(params: GenerateParams) -> tuple[str, ...]:
    """The ensemble outputs a chunk is made of: asking for no others spares Triton and
    the replica a serialization and a parse of each per response."""
    # output_ids always: a lost replica's answer resumes from them (serve/migration.py).
    specs = [
        contract.TEXT_OUTPUT,
        contract.OUTPUT_IDS,
        contract.NUM_INPUT_TOKENS,
        contract.NUM_OUTPUT_TOKENS,
        # On a request's first response, and on its last (where the engine has them).
        contract.NUM_CACHED_TOKENS,
        contract.FINISH_REASON,
    ]
    if params.return_log_probs:
        specs += (contract.CUM_LOG_PROBS, contract.OUTPUT_LOG_PROBS)
    if params.top_log_probs:
        specs += (contract.TOP_LOG_PROBS, contract.TOP_TOKEN_IDS)
    if params.prompt_log_probs:
        specs += (contract.PROMPT_TOKEN_IDS, contract.PROMPT_LOG_PROBS)
        if params.top_log_probs:
            specs += (contract.PROMPT_TOP_LOG_PROBS, contract.PROMPT_TOP_TOKEN_IDS)
    return tuple(spec.name for spec in specs)


def stop_inputs() -> dict[str, np.ndarray]:
    """A ``tensorrt_llm`` request that stops the request with the same id."""
    values: dict[str, np.ndarray] = {}
    _put(values, contract.INPUT_IDS, 0)
    _put(values, contract.INPUT_LENGTHS, 1)
    _put(values, contract.REQUEST_OUTPUT_LEN, 1)
    _put(values, contract.STOP, True)
    return values


def chunk_from_outputs(
    outputs: dict[str, np.ndarray],
    params: GenerateParams,
    earlier: GenerationChunk | None = None,
    detokenizer: IncrementalDetokenizer | None = None,
) -> GenerationChunk:
    """One streamed ensemble response as a chunk (not yet knowing if it is the last);
    ``earlier``, the request's previous chunk, holds what only the first response says.
    The text is the response's ``text_output``, or with ``detokenizer`` (the request's
    own, in the replica) the text its ``output_ids`` complete."""

    def scalar(spec: contract.Tensor):
        return outputs[spec.name].reshape(-1)[0] if spec.name in outputs else None

    ids = outputs.get(contract.OUTPUT_IDS.name, _NO_IDS).reshape(-1).tolist()  # [1, 1, new]
    if detokenizer is not None:
        text = detokenizer.add(ids)
    else:
        text = scalar(contract.TEXT_OUTPUT)
        text = text.decode() if isinstance(text, bytes) else str(text or "")
    cached = scalar(contract.NUM_CACHED_TOKENS)
    chunk = GenerationChunk(
        text=text,
        token_ids=tuple(ids),
        num_input_tokens=int(scalar(contract.NUM_INPUT_TOKENS) or 0),
        num_output_tokens=int(scalar(contract.NUM_OUTPUT_TOKENS) or 0),
        num_cached_tokens=int(cached or (earlier.num_cached_tokens if earlier else 0)),
    )
    if not params.return_log_probs:
        return chunk
    cum = scalar(contract.CUM_LOG_PROBS)
    log_probs = outputs.get(contract.OUTPUT_LOG_PROBS.name, np.empty(0)).reshape(-1)
    # The end token's log probability, after the others, where the engine ended on it
    # (tritonllm.contract: FINISH_END_ID); beyond that, what the engine padded.
    logged = len(ids) + (scalar(contract.FINISH_REASON) == contract.FINISH_END_ID)
    top = ()
    if params.top_log_probs:
        top = _top(outputs, contract.TOP_TOKEN_IDS, contract.TOP_LOG_PROBS, logged)
    return dataclasses.replace(
        chunk,
        cum_log_prob=None if cum is None else float(cum),
        token_log_probs=tuple(log_probs[:logged].tolist()),
        top_log_probs=top,
        prompt=_prompt(outputs) if params.prompt_log_probs else None,
    )


def _top(
    outputs: dict[str, np.ndarray],
    ids_spec: contract.Tensor,
    values_spec: contract.Tensor,
    positions: int,
) -> tuple[TopLogProbs, ...]:
    """The alternatives' ids and log probabilities ([1, rows, k] each) of the first
    ``positions`` rows."""
    if ids_spec.name not in outputs or not positions:  # (the final response: none)
        return ()
    ids, values = (_rows(outputs[spec.name], positions) for spec in (ids_spec, values_spec))
    return tuple(TopLogProbs(tuple(i), tuple(v)) for i, v in zip(ids, values, strict=True))


def _rows(table: np.ndarray, count: int) -> list[list]:
    return table.reshape(-1, table.shape[-1])[:count].tolist()


def _prompt(outputs: dict[str, np.ndarray]) -> PromptLogProbs | None:
    """The prompt's log probabilities, on a request's first response (None on the others);
    the first token has none."""
    if contract.PROMPT_TOKEN_IDS.name not in outputs:
        return None
    ids = tuple(outputs[contract.PROMPT_TOKEN_IDS.name].reshape(-1).tolist())
    chosen = outputs[contract.PROMPT_LOG_PROBS.name].reshape(-1).tolist()
    top = _top(outputs, contract.PROMPT_TOP_TOKEN_IDS, contract.PROMPT_TOP_LOG_PROBS, len(ids))
    return PromptLogProbs(
        token_ids=ids,
        log_probs=(None, *chosen[1:]),
        top_log_probs=(None, *top[1:]) if top else (),
    )


class ResponseReader:
    """One request's responses as chunks (:meth:`chunk` each response's outputs, then
    :meth:`end`): the loop both hosts run. Outputs carry the ensemble's names; with a
    ``detokenizer`` the text comes from it, not from ``text_output``."""

    def __init__(self, params: GenerateParams, detokenizer: IncrementalDetokenizer | None = None):
        self.params = params
        self.detokenizer = detokenizer
        self.last: GenerationChunk | None = None
        self.reason: str | None = None  # the engine's, on its last response

    def chunk(self, outputs: dict[str, np.ndarray]) -> GenerationChunk:
        code = outputs.get(contract.FINISH_REASON.name)
        if code is not None:
            self.reason = contract.FINISH_REASONS.get(int(code.reshape(-1)[0]), self.reason)
        self.last = chunk_from_outputs(outputs, self.params, self.last, self.detokenizer)
        return self.last

    def end(self) -> GenerationChunk:
        return final_chunk(self.last, self.params, self.reason)


def final_chunk(
    last: GenerationChunk | None, params: GenerateParams, reason: str | None = None
) -> GenerationChunk:
    """The empty chunk that ends every stream, with the counts so far and the reason:
    the engine's, else :func:`inferred_finish_reason`."""
    return GenerationChunk(
        text="",
        num_input_tokens=last.num_input_tokens if last else 0,
        num_output_tokens=last.num_output_tokens if last else 0,
        cum_log_prob=last.cum_log_prob if last else None,
        finish_reason=reason or inferred_finish_reason(last, params),
        num_cached_tokens=last.num_cached_tokens if last else 0,
    )


def inferred_finish_reason(last: GenerationChunk | None, params: GenerateParams) -> str:
    """For an engine that does not say (TensorRT-LLM's backends): ``length`` when
    max_tokens ended the answer, else ``stop`` (the end token or a stop word), so a stop
    word that lands exactly on the max_tokens-th token reads as ``length``."""
    produced = last.num_output_tokens if last else 0
    return "length" if produced >= params.max_tokens else "stop"


class Route(Protocol):
    """Which Triton model a generation goes to, with which tensors, and how its responses
    become chunks: through the ensemble (:class:`EnsembleRoute`), or to the engine step
    with the tokenizing and detokenizing done in the replica
    (:class:`serve.engines.triton.steps.ReplicaSteps`)."""

    model: str

    def inputs(
        self, params: GenerateParams, adapter: AdapterInputs | None = None
    ) -> dict[str, np.ndarray]:
        """The request's input tensors (``adapter``'s with them), named as ``model``
        takes them."""

    def outputs(self, params: GenerateParams) -> tuple[str, ...]:
        """The outputs of ``model`` a chunk is made of."""

    def reader(self, params: GenerateParams) -> ResponseReader:
        """Reads the request's responses (``model``'s output names) into chunks."""


@dataclasses.dataclass(frozen=True)
class EnsembleRoute:
    """Through the ensemble: Triton's preprocessing and postprocessing models tokenize
    and detokenize."""

    model: str = contract.ENSEMBLE

    def inputs(
        self, params: GenerateParams, adapter: AdapterInputs | None = None
    ) -> dict[str, np.ndarray]:
        return ensemble_inputs(params, adapter)

    def outputs(self, params: GenerateParams) -> tuple[str, ...]:
        return ensemble_outputs(params)

    def reader(self, params: GenerateParams) -> ResponseReader:
        return ResponseReader(params)


ENSEMBLE_ROUTE = EnsembleRoute()
