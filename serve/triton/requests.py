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

_NO_IDS = np.empty(0, dtype=np.int32)

_OPTIONAL_SCALARS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
)


def ensemble_inputs(params: GenerateParams) -> dict[str, np.ndarray]:
    """The ensemble's input tensors (batch 1, streamed, prompt excluded from the output)."""
    values = {
        "text_input": np.array([[params.prompt.encode()]], dtype=object),
        "max_tokens": np.array([[params.max_tokens]], dtype=np.int32),
        "stream": np.array([[True]]),
        "exclude_input_in_output": np.array([[True]]),
        "return_num_input_tokens": np.array([[True]]),
        "return_num_output_tokens": np.array([[True]]),
        "return_log_probs": np.array([[params.return_log_probs]]),
    }
    for name in _OPTIONAL_SCALARS:
        value = getattr(params, name)
        if value is not None:
            spec = contract.tensor(contract.ENSEMBLE, name)
            values[name] = np.array([[value]], dtype=spec.numpy_dtype)
    if params.prompt_token_ids:
        values["input_ids"] = np.array([params.prompt_token_ids], dtype=np.int32)
    if params.resumed_tokens:
        values["resumed_output_len"] = np.array([[params.resumed_tokens]], dtype=np.int32)
    if params.ignore_eos:  # TensorRT-LLM's "no end id"
        values["end_id"] = np.array([[-1]], dtype=np.int32)
    if params.stop:
        values["stop_words"] = np.array([[w.encode() for w in params.stop]], dtype=object)
    if params.top_log_probs:
        values["num_top_log_probs"] = np.array([[params.top_log_probs]], dtype=np.int32)
    if params.prompt_log_probs:
        values["return_prompt_log_probs"] = np.array([[True]])
    if params.guide_type:  # TensorRT-LLM's guided decoding (XGrammar)
        for name, text in (("type", params.guide_type), ("", params.guide)):
            tensor = f"guided_decoding_guide_{name}".rstrip("_")
            values[tensor] = np.array([[text.encode()]], dtype=object)
    if params.logit_bias:
        ids, weights = zip(*params.logit_bias, strict=True)
        values["embedding_bias_token_ids"] = np.array([ids], dtype=np.int32)
        values["embedding_bias_weights"] = np.array([weights], dtype=np.float32)
    return values | _lora_inputs(params)


def _lora_inputs(params: GenerateParams) -> dict[str, np.ndarray]:
    """TensorRT-LLM's LoRA inputs: the task id, and the weights when the replica sends
    them (the engine's first use of the adapter; docs/lora.md)."""
    if params.lora_task_id is None:
        return {}
    values = {"lora_task_id": np.array([[params.lora_task_id]], dtype=np.uint64)}
    if params.lora_tensors is not None:
        values["lora_weights"] = params.lora_tensors.weights.astype(np.float16)[None]
        values["lora_config"] = params.lora_tensors.config.astype(np.int32)[None]
    return values


def ensemble_outputs(params: GenerateParams) -> tuple[str, ...]:
    """The ensemble outputs a chunk is made of: asking for no others spares Triton and
    the replica a serialization and a parse of each per response."""
    # output_ids always: a lost replica's answer resumes from them (serve/migration.py).
    names = ("text_output", "output_ids", "num_input_tokens", "num_output_tokens")
    # On a request's first response, and on its last (where the engine has them).
    names += ("num_cached_tokens", "finish_reason")
    if params.return_log_probs:
        names += ("cum_log_probs", "output_log_probs")
    if params.top_log_probs:
        names += ("top_log_probs", "top_token_ids")
    if params.prompt_log_probs:
        names += ("prompt_token_ids", "prompt_log_probs")
        names += ("prompt_top_log_probs", "prompt_top_token_ids") if params.top_log_probs else ()
    return names


def stop_inputs() -> dict[str, np.ndarray]:
    """A ``tensorrt_llm`` request that stops the request with the same id."""
    return {
        "input_ids": np.zeros((1, 1), dtype=np.int32),
        "input_lengths": np.ones((1, 1), dtype=np.int32),
        "request_output_len": np.ones((1, 1), dtype=np.int32),
        "stop": np.array([[True]]),
    }


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

    def scalar(name: str):
        return outputs[name].reshape(-1)[0] if name in outputs else None

    ids = outputs.get("output_ids", _NO_IDS).reshape(-1).tolist()  # [1, beam 1, new tokens]
    if detokenizer is not None:
        text = detokenizer.add(ids)
    else:
        text = scalar("text_output")
        text = text.decode() if isinstance(text, bytes) else str(text or "")
    chunk = GenerationChunk(
        text=text,
        token_ids=tuple(ids),
        num_input_tokens=int(scalar("num_input_tokens") or 0),
        num_output_tokens=int(scalar("num_output_tokens") or 0),
        num_cached_tokens=int(
            scalar("num_cached_tokens") or (earlier.num_cached_tokens if earlier else 0)
        ),
    )
    if not params.return_log_probs:
        return chunk
    cum = scalar("cum_log_probs")
    log_probs = outputs.get("output_log_probs", np.empty(0)).reshape(-1)[: len(ids)]
    return dataclasses.replace(
        chunk,
        cum_log_prob=None if cum is None else float(cum),
        token_log_probs=tuple(log_probs.tolist()),
        top_log_probs=_top(outputs, "top", len(ids)) if params.top_log_probs else (),
        prompt=_prompt(outputs) if params.prompt_log_probs else None,
    )


def _top(outputs: dict[str, np.ndarray], prefix: str, positions: int) -> tuple[TopLogProbs, ...]:
    """``{prefix}_token_ids`` and ``{prefix}_log_probs`` ([1, positions, k]) per position."""
    if f"{prefix}_token_ids" not in outputs or not positions:  # (the final response: none)
        return ()
    ids = outputs[f"{prefix}_token_ids"].reshape(positions, -1).tolist()
    values = outputs[f"{prefix}_log_probs"].reshape(positions, -1).tolist()
    return tuple(TopLogProbs(tuple(i), tuple(v)) for i, v in zip(ids, values, strict=True))


def _prompt(outputs: dict[str, np.ndarray]) -> PromptLogProbs | None:
    """The prompt's log probabilities, on a request's first response (None on the others);
    the first token has none."""
    if "prompt_token_ids" not in outputs:
        return None
    ids = tuple(outputs["prompt_token_ids"].reshape(-1).tolist())
    chosen = outputs["prompt_log_probs"].reshape(-1).tolist()
    top = _top(outputs, "prompt_top", len(ids))
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
        code = outputs.get("finish_reason")
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
    (:class:`serve.triton.steps.ReplicaSteps`)."""

    model: str

    def inputs(self, params: GenerateParams) -> dict[str, np.ndarray]:
        """The request's input tensors, named as ``model`` takes them."""

    def outputs(self, params: GenerateParams) -> tuple[str, ...]:
        """The outputs of ``model`` a chunk is made of."""

    def reader(self, params: GenerateParams) -> ResponseReader:
        """Reads the request's responses (``model``'s output names) into chunks."""


@dataclasses.dataclass(frozen=True)
class EnsembleRoute:
    """Through the ensemble: Triton's preprocessing and postprocessing models tokenize
    and detokenize."""

    model: str = contract.ENSEMBLE

    def inputs(self, params: GenerateParams) -> dict[str, np.ndarray]:
        return ensemble_inputs(params)

    def outputs(self, params: GenerateParams) -> tuple[str, ...]:
        return ensemble_outputs(params)

    def reader(self, params: GenerateParams) -> ResponseReader:
        return ResponseReader(params)


ENSEMBLE_ROUTE = EnsembleRoute()
