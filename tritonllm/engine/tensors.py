"""tensorrt_llm tensors <-> GenerationRequest / GenerationChunk (no pb_utils here)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tritonllm.contract import FINISH_REASON_CODES
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.sampling import SamplingParams
from tritonllm.engine.scheduler import GenerationChunk
from tritonllm.lora import LoraTensors
from tritonllm.tokenization import InvalidRequest, from_word_list

Getter = Callable[[str], "np.ndarray | None"]


def _scalar(get: Getter, name: str, cast, default=None):
    value = get(name)
    if value is None:
        return default
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got shape {list(value.shape)}")
    return cast(flat[0])


def _word_list(get: Getter, name: str) -> tuple[tuple[int, ...], ...]:
    value = get(name)
    if value is None:
        return ()
    value = np.asarray(value)
    return tuple(tuple(w) for w in from_word_list(value.reshape(value.shape[-2:])))


def _logit_bias(get: Getter) -> tuple[tuple[int, float], ...]:
    """The dense ``embedding_bias`` ([vocabulary], or [0]: none) as (token id, bias) pairs."""
    value = get("embedding_bias")
    if value is None:
        return ()
    bias = np.asarray(value, dtype=np.float32).reshape(-1)
    ids = np.flatnonzero(bias)
    return tuple(zip(ids.tolist(), bias[ids].tolist(), strict=True))


def _text(get: Getter, name: str) -> str | None:
    """A STRING [1] tensor's text (bytes decoded as UTF-8), or None when absent."""
    value = _scalar(get, name, lambda v: v)
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{name} is not valid UTF-8") from None
    return str(value)


def _guide(get: Getter) -> tuple[str | None, str]:
    """(guide type, guide): an absent or empty type is no guided decoding."""
    guide_type = _text(get, "guided_decoding_guide_type") or None
    return guide_type, _text(get, "guided_decoding_guide") or ""


def _lora(get: Getter) -> LoraTensors | None:
    """The adapter's ``lora_weights`` and ``lora_config`` (batch dimension dropped), or
    None when the request names its adapter by ``lora_task_id`` alone."""
    weights, config = get("lora_weights"), get("lora_config")
    if weights is None and config is None:
        return None
    if weights is None or config is None:
        raise InvalidRequest("lora_weights and lora_config must be sent together")
    weights, config = np.asarray(weights), np.asarray(config)
    if weights.ndim != 3 or config.ndim != 3 or weights.shape[0] != 1 or config.shape[0] != 1:
        raise InvalidRequest(
            f"lora_weights {list(weights.shape)} and lora_config {list(config.shape)}: "
            "expected [1, module-layers, row] and [1, module-layers, 3]"
        )
    return LoraTensors(weights[0].astype(np.float16), config[0].astype(np.int32))


def is_stop_request(get: Getter) -> bool:
    return bool(_scalar(get, "stop", bool, False))


def to_generation_request(request_id: str, get: Getter) -> GenerationRequest:
    """Read one tensorrt_llm request (batch dimension 1)."""
    input_ids = np.asarray(get("input_ids"))
    if input_ids.ndim == 2 and input_ids.shape[0] != 1:
        raise InvalidRequest(
            f"batch size {input_ids.shape[0]} per request is not supported by the in-flight "
            "batcher; send one request per prompt"
        )
    length = _scalar(get, "input_lengths", int, input_ids.shape[-1])
    beam_width = _scalar(get, "beam_width", int, 1)
    if beam_width != 1:
        raise InvalidRequest(f"beam_width {beam_width} is not supported by the torch engine; use 1")
    sampling = SamplingParams(
        temperature=_scalar(get, "temperature", float),
        top_k=_scalar(get, "runtime_top_k", int, 0),
        top_p=_scalar(get, "runtime_top_p", float),
        seed=_scalar(get, "seed", int),
        repetition_penalty=_scalar(get, "repetition_penalty", float, 1.0),
        presence_penalty=_scalar(get, "presence_penalty", float, 0.0),
        frequency_penalty=_scalar(get, "frequency_penalty", float, 0.0),
        min_tokens=_scalar(get, "min_tokens", int, 0),
        bad_words=_word_list(get, "bad_words_list"),
        logit_bias=_logit_bias(get),
    )
    guide_type, guide = _guide(get)
    return GenerationRequest(
        request_id=request_id,
        input_ids=tuple(int(t) for t in input_ids.reshape(-1)[:length]),
        max_tokens=_scalar(get, "request_output_len", int),
        end_id=_scalar(get, "end_id", int),
        pad_id=_scalar(get, "pad_id", int),
        stop_words=_word_list(get, "stop_words_list"),
        sampling=sampling,
        streaming=_scalar(get, "streaming", bool, False),
        exclude_input_in_output=_scalar(get, "exclude_input_in_output", bool, False),
        return_log_probs=_scalar(get, "return_log_probs", bool, False),
        num_top_log_probs=_scalar(get, "num_top_log_probs", int, 0),
        return_prompt_log_probs=_scalar(get, "return_prompt_log_probs", bool, False),
        guide_type=guide_type,
        guide=guide,
        lora_task_id=_scalar(get, "lora_task_id", int),
        lora=_lora(get),
        resumed_output_len=_scalar(get, "resumed_output_len", int, 0),
    )


def chunk_to_tensors(chunk: GenerationChunk, request: GenerationRequest) -> dict[str, np.ndarray]:
    """The tensorrt_llm outputs of one response, with the batch dimension (1)."""
    log_probs = chunk.log_probs if request.return_log_probs else [0.0] * len(chunk.token_ids)
    cum = chunk.cum_log_prob if request.return_log_probs else 0.0
    return {
        "output_ids": np.array([[chunk.token_ids]], dtype=np.int32).reshape(1, 1, -1),
        "sequence_length": np.array([[len(chunk.token_ids)]], dtype=np.int32),
        "cum_log_probs": np.array([[cum]], dtype=np.float32),
        "output_log_probs": np.array([[log_probs]], dtype=np.float32).reshape(1, 1, -1),
        "num_input_tokens": np.array([[chunk.num_input_tokens]], dtype=np.int32),
        "num_output_tokens": np.array([[chunk.num_output_tokens]], dtype=np.int32),
        "batch_index": np.zeros((1, 1), dtype=np.int32),
        **_extension_tensors(chunk, request),
    }


def _extension_tensors(chunk: GenerationChunk, request: GenerationRequest) -> dict:
    """Our outputs beyond upstream's, each only in the responses that carry it."""
    tensors = {}
    if request.num_top_log_probs and request.return_log_probs:
        tensors |= _top_tensors("top", chunk.top_log_probs, request.num_top_log_probs)
    if chunk.finished and chunk.finish_reason in FINISH_REASON_CODES:  # the last response
        code = FINISH_REASON_CODES[chunk.finish_reason]
        tensors["finish_reason"] = np.array([[code]], dtype=np.int32)
    if chunk.num_cached_tokens is not None:  # the first response
        tensors["num_cached_tokens"] = np.array([[chunk.num_cached_tokens]], dtype=np.int32)
    if chunk.prompt_log_probs is not None:
        # The first prompt token has no log probability: 0 stands in its place.
        chosen = [0.0] + [p.chosen for p in chunk.prompt_log_probs]
        tensors["prompt_token_ids"] = np.array([chunk.prompt_ids], dtype=np.int32)
        tensors["prompt_log_probs"] = np.array([chosen], dtype=np.float32)
        if request.num_top_log_probs:
            top = _top_tensors("prompt_top", chunk.prompt_log_probs, request.num_top_log_probs)
            tensors |= {name: np.pad(v, ((0, 0), (1, 0), (0, 0))) for name, v in top.items()}
    return tensors


def _top_tensors(prefix: str, positions, k: int) -> dict[str, np.ndarray]:
    """``{prefix}_log_probs`` and ``{prefix}_token_ids``, each ``[1, positions, k]``."""
    values = np.array([p.top_values for p in positions], dtype=np.float32).reshape(1, -1, k)
    ids = np.array([p.top_ids for p in positions], dtype=np.int32).reshape(1, -1, k)
    return {f"{prefix}_log_probs": values, f"{prefix}_token_ids": ids}
