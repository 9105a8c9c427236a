"""tensorrt_llm tensors <-> GenerationRequest / GenerationChunk (no pb_utils here)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tritonllm import contract
from tritonllm.engine.request import GenerationRequest
from tritonllm.engine.sampling import SamplingParams
from tritonllm.engine.scheduler import GenerationChunk
from tritonllm.lora import LoraTensors
from tritonllm.tokenization import InvalidRequest, from_word_list

Getter = Callable[[str], "np.ndarray | None"]


def _scalar(get: Getter, spec: contract.Tensor, cast, default=None):
    name = spec.name
    value = get(name)
    if value is None:
        return default
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got shape {list(value.shape)}")
    return cast(flat[0])


def _word_list(get: Getter, spec: contract.Tensor) -> tuple[tuple[int, ...], ...]:
    value = get(spec.name)
    if value is None:
        return ()
    value = np.asarray(value)
    return tuple(tuple(w) for w in from_word_list(value.reshape(value.shape[-2:])))


def _logit_bias(get: Getter) -> tuple[tuple[int, float], ...]:
    """The dense ``embedding_bias`` ([vocabulary], or [0]: none) as (token id, bias) pairs."""
    value = get(contract.EMBEDDING_BIAS.name)
    if value is None:
        return ()
    bias = np.asarray(value, dtype=np.float32).reshape(-1)
    ids = np.flatnonzero(bias)
    return tuple(zip(ids.tolist(), bias[ids].tolist(), strict=True))


def _text(get: Getter, spec: contract.Tensor) -> str | None:
    """A STRING [1] tensor's text (bytes decoded as UTF-8), or None when absent."""
    value = _scalar(get, spec, lambda v: v)
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{spec.name} is not valid UTF-8") from None
    return str(value)


def _guide(get: Getter) -> tuple[str | None, str]:
    """(guide type, guide): an absent or empty type is no guided decoding."""
    guide_type = _text(get, contract.GUIDED_DECODING_GUIDE_TYPE) or None
    return guide_type, _text(get, contract.GUIDED_DECODING_GUIDE) or ""


def _lora(get: Getter) -> LoraTensors | None:
    """The adapter's ``lora_weights`` and ``lora_config`` (batch dimension dropped), or
    None when the request names its adapter by ``lora_task_id`` alone."""
    weights, config = get(contract.LORA_WEIGHTS.name), get(contract.LORA_CONFIG.name)
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
    return bool(_scalar(get, contract.STOP, bool, False))


def to_generation_request(request_id: str, get: Getter) -> GenerationRequest:
    """Read one tensorrt_llm request (batch dimension 1)."""
    input_ids = np.asarray(get(contract.INPUT_IDS.name))
    if input_ids.ndim == 2 and input_ids.shape[0] != 1:
        raise InvalidRequest(
            f"batch size {input_ids.shape[0]} per request is not supported by the in-flight "
            "batcher; send one request per prompt"
        )
    length = _scalar(get, contract.INPUT_LENGTHS, int, input_ids.shape[-1])
    beam_width = _scalar(get, contract.BEAM_WIDTH, int, 1)
    if beam_width != 1:
        raise InvalidRequest(f"beam_width {beam_width} is not supported by the torch engine; use 1")
    sampling = SamplingParams(
        temperature=_scalar(get, contract.TEMPERATURE, float),
        top_k=_scalar(get, contract.RUNTIME_TOP_K, int, 0),
        top_p=_scalar(get, contract.RUNTIME_TOP_P, float),
        seed=_scalar(get, contract.SEED, int),
        repetition_penalty=_scalar(get, contract.REPETITION_PENALTY, float, 1.0),
        presence_penalty=_scalar(get, contract.PRESENCE_PENALTY, float, 0.0),
        frequency_penalty=_scalar(get, contract.FREQUENCY_PENALTY, float, 0.0),
        min_tokens=_scalar(get, contract.MIN_TOKENS, int, 0),
        bad_words=_word_list(get, contract.BAD_WORDS_LIST),
        logit_bias=_logit_bias(get),
    )
    guide_type, guide = _guide(get)
    return GenerationRequest(
        request_id=request_id,
        input_ids=tuple(int(t) for t in input_ids.reshape(-1)[:length]),
        max_tokens=_scalar(get, contract.REQUEST_OUTPUT_LEN, int),
        end_id=_scalar(get, contract.END_ID, int),
        pad_id=_scalar(get, contract.PAD_ID, int),
        stop_words=_word_list(get, contract.STOP_WORDS_LIST),
        sampling=sampling,
        streaming=_scalar(get, contract.STREAMING, bool, False),
        exclude_input_in_output=_scalar(get, contract.EXCLUDE_INPUT_IN_OUTPUT, bool, False),
        return_log_probs=_scalar(get, contract.RETURN_LOG_PROBS, bool, False),
        num_top_log_probs=_scalar(get, contract.NUM_TOP_LOG_PROBS, int, 0),
        return_prompt_log_probs=_scalar(get, contract.RETURN_PROMPT_LOG_PROBS, bool, False),
        guide_type=guide_type,
        guide=guide,
        lora_task_id=_scalar(get, contract.LORA_TASK_ID, int),
        lora=_lora(get),
        resumed_output_len=_scalar(get, contract.RESUMED_OUTPUT_LEN, int, 0),
        priority=_scalar(get, contract.PRIORITY, int, 0),
    )


def chunk_to_tensors(chunk: GenerationChunk, request: GenerationRequest) -> dict[str, np.ndarray]:
    """The tensorrt_llm outputs of one response, with the batch dimension (1)."""
    log_probs = chunk.log_probs if request.return_log_probs else [0.0] * len(chunk.token_ids)
    cum = chunk.cum_log_prob if request.return_log_probs else 0.0
    return {
        contract.OUTPUT_IDS.name: np.array([[chunk.token_ids]], dtype=np.int32).reshape(1, 1, -1),
        contract.SEQUENCE_LENGTH.name: np.array([[len(chunk.token_ids)]], dtype=np.int32),
        contract.CUM_LOG_PROBS.name: np.array([[cum]], dtype=np.float32),
        contract.OUTPUT_LOG_PROBS.name: np.array([[log_probs]], dtype=np.float32).reshape(1, 1, -1),
        contract.NUM_INPUT_TOKENS.name: np.array([[chunk.num_input_tokens]], dtype=np.int32),
        contract.NUM_OUTPUT_TOKENS.name: np.array([[chunk.num_output_tokens]], dtype=np.int32),
        contract.BATCH_INDEX.name: np.zeros((1, 1), dtype=np.int32),
        **_extension_tensors(chunk, request),
    }


def _extension_tensors(chunk: GenerationChunk, request: GenerationRequest) -> dict:
    """Our outputs beyond upstream's, each only in the responses that carry it."""
    tensors = {}
    k = request.num_top_log_probs
    if k and request.return_log_probs:
        top = _top_tensors(chunk.top_log_probs, k)
        tensors[contract.TOP_LOG_PROBS.name], tensors[contract.TOP_TOKEN_IDS.name] = top
    codes = contract.FINISH_REASON_CODES
    if chunk.finished and chunk.finish_reason in codes:  # the last response
        code = contract.FINISH_END_ID if chunk.ended_by_end_id else codes[chunk.finish_reason]
        tensors[contract.FINISH_REASON.name] = np.array([[code]], dtype=np.int32)
    if chunk.num_cached_tokens is not None:  # the first response
        cached = np.array([[chunk.num_cached_tokens]], dtype=np.int32)
        tensors[contract.NUM_CACHED_TOKENS.name] = cached
    if chunk.prompt_log_probs is not None:
        # The first prompt token has no log probability: 0 stands in its place.
        chosen = [0.0] + [p.chosen for p in chunk.prompt_log_probs]
        tensors[contract.PROMPT_TOKEN_IDS.name] = np.array([chunk.prompt_ids], dtype=np.int32)
        tensors[contract.PROMPT_LOG_PROBS.name] = np.array([chosen], dtype=np.float32)
        if k:
            values, ids = (
                np.pad(v, ((0, 0), (1, 0), (0, 0))) for v in _top_tensors(chunk.prompt_log_probs, k)
            )
            tensors[contract.PROMPT_TOP_LOG_PROBS.name] = values
            tensors[contract.PROMPT_TOP_TOKEN_IDS.name] = ids
    return tensors


def _top_tensors(positions, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The alternatives' log probabilities and token ids, each ``[1, positions, k]``."""
    values = np.array([p.top_values for p in positions], dtype=np.float32).reshape(1, -1, k)
    ids = np.array([p.top_ids for p in positions], dtype=np.int32).reshape(1, -1, k)
    return values, ids
