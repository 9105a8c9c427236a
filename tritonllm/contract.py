"""The tensor contract of the model repository: the single source of truth.

Names, types and shapes follow NVIDIA's ``inflight_batcher_llm`` templates, so a
repository built by TensorRT-LLM's own tools and ours are interchangeable behind
the Serve app. Shapes are given without the batch dimension (every model here has
``max_batch_size > 0``, as upstream). The config templates under
``model_repository/`` are checked against this module by the unit tests, and the
Python models and clients take their tensor names from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tensor:
    name: str
    triton_dtype: str  # as written in config.pbtxt, e.g. "TYPE_INT32"
    dims: tuple[int, ...]
    optional: bool = False
    # Ours, read or written by the tensorrt_llm step, which TensorRT-LLM's backends lack:
    # the trtllm targets' configs leave these out (the API refuses what needs them).
    engine_extension: bool = False

    @property
    def numpy_dtype(self) -> type:
        return _NUMPY_DTYPES[self.triton_dtype]

    @property
    def wire_dtype(self) -> str:
        """The datatype name used on the wire by tritonclient (``"INT32"``)."""
        return "BYTES" if self.triton_dtype == "TYPE_STRING" else self.triton_dtype[5:]


_NUMPY_DTYPES = {
    "TYPE_STRING": np.object_,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_UINT64": np.uint64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_BOOL": np.bool_,
}


def _t(name: str, dtype: str, *dims: int, optional: bool = False) -> Tensor:
    return Tensor(name, f"TYPE_{dtype}", tuple(dims), optional)


def _opt(name: str, dtype: str, *dims: int) -> Tensor:
    return _t(name, dtype, *dims, optional=True)


def _ext(name: str, dtype: str, *dims: int, optional: bool = False) -> Tensor:
    return Tensor(name, f"TYPE_{dtype}", tuple(dims), optional, engine_extension=True)


ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
TENSORRT_LLM = "tensorrt_llm"
POSTPROCESSING = "postprocessing"

# Ours, beside upstream's tensors of the ensemble and the tensorrt_llm step (the torch
# engine serves them; TensorRT-LLM's backends do not). With return_log_probs, this many
# alternatives per generated token (0-20), and the prompt's own log probabilities
# (completions' echo).
_ENGINE_EXTENSION_INPUTS = (
    _ext("num_top_log_probs", "INT32", 1, optional=True),
    _ext("return_prompt_log_probs", "BOOL", 1, optional=True),
    # A request resumed where another replica lost it (serve/migration.py): the last
    # this-many input ids are its own earlier output. The engine counts them as
    # generated for the presence and frequency penalties, replays the guide's grammar
    # over them and draws the next token as the seed's next draw; max_tokens and
    # min_tokens count only the new tokens.
    _ext("resumed_output_len", "INT32", 1, optional=True),
)

# A response carries these when asked for; the prompt's and the cache count on a
# request's first response only.
_ENGINE_EXTENSION_OUTPUTS = (
    _ext("top_log_probs", "FP32", -1, -1),  # [new tokens, k]
    _ext("top_token_ids", "INT32", -1, -1),
    _ext("prompt_token_ids", "INT32", -1),
    _ext("prompt_log_probs", "FP32", -1),  # the first token's is 0: nothing precedes it
    _ext("prompt_top_log_probs", "FP32", -1, -1),  # [prompt tokens, k]
    _ext("prompt_top_token_ids", "INT32", -1, -1),
    _ext("num_cached_tokens", "INT32", 1),  # prompt tokens read from the prefix cache
    # Why the sequence ended, on its last response only: FINISH_REASONS' codes.
    _ext("finish_reason", "INT32", 1),
)

# The finish_reason output's codes: TensorRT-LLM's (its executor's FinishReason), each
# with the API's word for it. The torch engine sends 1 for every stop (the end token, a
# stop word, a guide completed), 3 at max_tokens, 5 for a stopped request.
FINISH_REASONS = {1: "stop", 2: "stop", 3: "length", 4: "length", 5: "cancelled"}
FINISH_REASON_CODES = {"stop": 1, "length": 3, "cancelled": 5}

# TensorRT-LLM's guided decoding inputs (its names and shapes, on the ensemble and the
# tensorrt_llm step alike) and its guide types (tritonllm/guided.py compiles them).
_GUIDED_DECODING_INPUTS = (
    _opt("guided_decoding_guide_type", "STRING", 1),
    _opt("guided_decoding_guide", "STRING", 1),
)
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")

# TensorRT-LLM's LoRA inputs (its names, types and shapes, on the ensemble and the
# tensorrt_llm step alike). A request names its adapter by task id; the first request
# with an id also carries the adapter, later ones the id alone:
# - lora_weights [module-layers, D*Hi + Ho*D]: per row the in weights [D, Hi] flattened,
#   then the out weights [Ho, D] flattened and already scaled by alpha / D, zero-padded
#   to the longest row (D: the adapter's rank, Hi/Ho: the module's in and out sizes);
# - lora_config [module-layers, 3]: LORA_MODULE_IDS[module], layer index, D.
# An engine that does not hold the id answers lora_cache_miss(id); the caller resends
# the request with the weights (tritonllm/lora.py converts a PEFT adapter).
_LORA_INPUTS = (
    _opt("lora_task_id", "UINT64", 1),
    _opt("lora_weights", "FP16", -1, -1),
    _opt("lora_config", "INT32", -1, 3),
)

# TensorRT-LLM's module ids (tensorrt_llm.lora_manager.LoraManager.LORA_MODULE_IDS).
LORA_MODULE_IDS = {
    "attn_qkv": 0,
    "attn_q": 1,
    "attn_k": 2,
    "attn_v": 3,
    "attn_dense": 4,
    "mlp_h_to_4h": 5,
    "mlp_4h_to_h": 6,
    "mlp_gate": 7,
}


def lora_cache_miss(task_id: int) -> str:
    """TensorRT-LLM's own words for a task id it does not hold (the caller matches them)."""
    return f"LoRA task {task_id} not found in cache. Please send LoRA weights with request"


LORA_CACHE_MISS = re.compile(r"LoRA task ([0-9]+) not found in cache")

ENSEMBLE_INPUTS = (
    _t("text_input", "STRING", 1),
    _t("max_tokens", "INT32", 1),
    # A prompt already tokenized (an extension of NVIDIA's ensemble): taken as it is,
    # instead of text_input (sent empty), with no special tokens added.
    _opt("input_ids", "INT32", -1),
    _opt("bad_words", "STRING", -1),
    _opt("stop_words", "STRING", -1),
    _opt("end_id", "INT32", 1),
    _opt("pad_id", "INT32", 1),
    _opt("top_k", "INT32", 1),
    _opt("top_p", "FP32", 1),
    _opt("temperature", "FP32", 1),
    _opt("length_penalty", "FP32", 1),
    _opt("repetition_penalty", "FP32", 1),
    _opt("min_tokens", "INT32", 1),
    _opt("presence_penalty", "FP32", 1),
    _opt("frequency_penalty", "FP32", 1),
    _opt("seed", "UINT64", 1),
    _opt("beam_width", "INT32", 1),
    _opt("stream", "BOOL", 1),
    _opt("exclude_input_in_output", "BOOL", 1),
    _opt("return_log_probs", "BOOL", 1),
    _opt("return_num_input_tokens", "BOOL", 1),
    _opt("return_num_output_tokens", "BOOL", 1),
    # Per-token biases added to the logits before sampling (OpenAI's logit_bias):
    # upstream's words and weights, or (ours) token ids with the weights.
    _opt("embedding_bias_words", "STRING", -1),
    _opt("embedding_bias_weights", "FP32", -1),
    _opt("embedding_bias_token_ids", "INT32", -1),
    # Guided decoding (structured outputs), as TensorRT-LLM's backends take it: one of
    # GUIDE_TYPES and the guide's text (a JSON Schema, a regex, an EBNF grammar, an
    # XGrammar structural tag; nothing for "json"). Straight to the tensorrt_llm step.
    *_GUIDED_DECODING_INPUTS,
    # LoRA adapters, as TensorRT-LLM's backends take them: straight to tensorrt_llm.
    *_LORA_INPUTS,
    *_ENGINE_EXTENSION_INPUTS,
)

ENSEMBLE_OUTPUTS = (
    _t("text_output", "STRING", -1),
    # The generated ids, as tensorrt_llm returns them (an extension of NVIDIA's
    # ensemble): the API names each token of a ``logprobs`` answer with them.
    _t("output_ids", "INT32", -1, -1),
    _t("cum_log_probs", "FP32", -1),
    _t("output_log_probs", "FP32", -1, -1),
    _t("num_input_tokens", "INT32", 1),
    _t("num_output_tokens", "INT32", 1),
    _t("batch_index", "INT32", 1),
    *_ENGINE_EXTENSION_OUTPUTS,
)

PREPROCESSING_INPUTS = (
    _t("QUERY", "STRING", 1),
    _t("REQUEST_OUTPUT_LEN", "INT32", 1),
    _opt("INPUT_IDS", "INT32", -1),
    _opt("BAD_WORDS_DICT", "STRING", -1),
    _opt("STOP_WORDS_DICT", "STRING", -1),
    _opt("END_ID", "INT32", 1),
    _opt("PAD_ID", "INT32", 1),
    _opt("EMBEDDING_BIAS_WORDS", "STRING", -1),
    _opt("EMBEDDING_BIAS_WEIGHTS", "FP32", -1),
    _opt("EMBEDDING_BIAS_TOKEN_IDS", "INT32", -1),
)

PREPROCESSING_OUTPUTS = (
    _t("INPUT_ID", "INT32", -1),
    _t("REQUEST_INPUT_LEN", "INT32", 1),
    _t("BAD_WORDS_IDS", "INT32", 2, -1),
    _t("STOP_WORDS_IDS", "INT32", 2, -1),
    _t("REQUEST_OUTPUT_LEN", "INT32", 1),
    _t("OUT_END_ID", "INT32", 1),
    _t("OUT_PAD_ID", "INT32", 1),
    # [vocabulary] floats, or [0] when the request has no bias (as upstream).
    _t("EMBEDDING_BIAS", "FP32", -1),
)

TENSORRT_LLM_INPUTS = (
    _t("input_ids", "INT32", -1),
    _t("input_lengths", "INT32", 1),
    _t("request_output_len", "INT32", 1),
    _opt("end_id", "INT32", 1),
    _opt("pad_id", "INT32", 1),
    _opt("stop_words_list", "INT32", 2, -1),
    _opt("bad_words_list", "INT32", 2, -1),
    _opt("beam_width", "INT32", 1),
    _opt("runtime_top_k", "INT32", 1),
    _opt("runtime_top_p", "FP32", 1),
    _opt("temperature", "FP32", 1),
    _opt("len_penalty", "FP32", 1),
    _opt("repetition_penalty", "FP32", 1),
    _opt("min_tokens", "INT32", 1),
    _opt("presence_penalty", "FP32", 1),
    _opt("frequency_penalty", "FP32", 1),
    _opt("seed", "UINT64", 1),
    _opt("streaming", "BOOL", 1),
    _opt("exclude_input_in_output", "BOOL", 1),
    _opt("return_log_probs", "BOOL", 1),
    _opt("return_num_input_tokens", "BOOL", 1),
    _opt("return_num_output_tokens", "BOOL", 1),
    _opt("embedding_bias", "FP32", -1),
    _opt("stop", "BOOL", 1),
    *_GUIDED_DECODING_INPUTS,
    *_LORA_INPUTS,
    *_ENGINE_EXTENSION_INPUTS,
)

TENSORRT_LLM_OUTPUTS = (
    _t("output_ids", "INT32", -1, -1),
    _t("sequence_length", "INT32", -1),
    _t("cum_log_probs", "FP32", -1),
    _t("output_log_probs", "FP32", -1, -1),
    _t("num_input_tokens", "INT32", 1),
    _t("num_output_tokens", "INT32", 1),
    _t("batch_index", "INT32", 1),
    *_ENGINE_EXTENSION_OUTPUTS,
)

POSTPROCESSING_INPUTS = (
    _t("TOKENS_BATCH", "INT32", -1, -1),
    _t("SEQUENCE_LENGTH", "INT32", -1),
)

POSTPROCESSING_OUTPUTS = (_t("OUTPUT", "STRING", -1),)

MODELS = {
    ENSEMBLE: (ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS),
    PREPROCESSING: (PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS),
    TENSORRT_LLM: (TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS),
    POSTPROCESSING: (POSTPROCESSING_INPUTS, POSTPROCESSING_OUTPUTS),
}

# A pool of fine-tuned variants shares pre/postprocessing; each variant has an engine
# step and an ensemble of its own, named after it. A variant's name is part of Triton
# model names and folder names, hence the pattern.
VARIANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def variant_ensemble(variant: str) -> str:
    return f"{ENSEMBLE}-{variant}"


def variant_engine(variant: str) -> str:
    return f"{TENSORRT_LLM}-{variant}"


# The embeddings model lives in its own repository (``embedding_repository/``) with its
# own Triton, so an LLM replica can hold a GPU while an embeddings replica runs on CPU.
# One request carries a batch of texts ([B, 1]); Triton's dynamic batcher may merge
# several requests into one execute, and each row's answer stays in its own row.
EMBEDDINGS = "embeddings"

EMBEDDINGS_INPUTS = (_t("text", "STRING", 1),)

EMBEDDINGS_OUTPUTS = (
    _t("embedding", "FP32", -1),  # L2-normalised sentence vector (384 floats for MiniLM-L6)
    _t("num_tokens", "INT32", 1),  # tokens the model read, special tokens included
)

EMBEDDING_MODELS = {EMBEDDINGS: (EMBEDDINGS_INPUTS, EMBEDDINGS_OUTPUTS)}

ALL_MODELS = {**MODELS, **EMBEDDING_MODELS}


# The most alternatives per token a request may ask for (OpenAI's top_logprobs bound).
MAX_TOP_LOG_PROBS = 20


def tensor(model: str, name: str) -> Tensor:
    """Look up one tensor of ``model`` (of either repository) by name, inputs first."""
    inputs, outputs = ALL_MODELS[model]
    for spec in (*inputs, *outputs):
        if spec.name == name:
            return spec
    raise KeyError(f"{model} has no tensor {name!r}")
