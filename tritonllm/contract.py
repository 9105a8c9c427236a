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
from dataclasses import dataclass, replace

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

# Each tensor once, by its name: code says ``contract.MAX_TOKENS.name`` (and reads its
# type from the same object), never the string. A tensor of the same name on the
# ensemble and the tensorrt_llm step is one object, listed by both models below.

# Ours, beside upstream's tensors of the ensemble and the tensorrt_llm step (the torch
# engine serves them; TensorRT-LLM's backends do not). With return_log_probs, this many
# alternatives per generated token (0-20), and the prompt's own log probabilities
# (completions' echo).
NUM_TOP_LOG_PROBS = _ext("num_top_log_probs", "INT32", 1, optional=True)
RETURN_PROMPT_LOG_PROBS = _ext("return_prompt_log_probs", "BOOL", 1, optional=True)
# A request resumed where another replica lost it (serve/migration.py): the last
# this-many input ids are its own earlier output. The engine counts them as generated
# for the presence and frequency penalties, replays the guide's grammar over them and
# draws the next token as the seed's next draw; max_tokens and min_tokens count only
# the new tokens.
RESUMED_OUTPUT_LEN = _ext("resumed_output_len", "INT32", 1, optional=True)
# The order in which a full engine admits its queued requests: lower first, equal ones
# first come, first served (vLLM's ``priority``; 0 when absent).
PRIORITY = _ext("priority", "INT32", 1, optional=True)
_ENGINE_EXTENSION_INPUTS = (
    NUM_TOP_LOG_PROBS,
    RETURN_PROMPT_LOG_PROBS,
    RESUMED_OUTPUT_LEN,
    PRIORITY,
)

# A response carries these when asked for; the prompt's and the cache count on a
# request's first response only.
TOP_LOG_PROBS = _ext("top_log_probs", "FP32", -1, -1)  # [new tokens, k]
TOP_TOKEN_IDS = _ext("top_token_ids", "INT32", -1, -1)
PROMPT_TOKEN_IDS = _ext("prompt_token_ids", "INT32", -1)
PROMPT_LOG_PROBS = _ext("prompt_log_probs", "FP32", -1)  # the first token's is 0
PROMPT_TOP_LOG_PROBS = _ext("prompt_top_log_probs", "FP32", -1, -1)  # [prompt tokens, k]
PROMPT_TOP_TOKEN_IDS = _ext("prompt_top_token_ids", "INT32", -1, -1)
NUM_CACHED_TOKENS = _ext("num_cached_tokens", "INT32", 1)  # prompt tokens from the cache
# Why the sequence ended, on its last response only: FINISH_REASONS' codes.
FINISH_REASON = _ext("finish_reason", "INT32", 1)
_ENGINE_EXTENSION_OUTPUTS = (
    TOP_LOG_PROBS,
    TOP_TOKEN_IDS,
    PROMPT_TOKEN_IDS,
    PROMPT_LOG_PROBS,
    PROMPT_TOP_LOG_PROBS,
    PROMPT_TOP_TOKEN_IDS,
    NUM_CACHED_TOKENS,
    FINISH_REASON,
)

# The finish_reason output's codes: TensorRT-LLM's (its executor's FinishReason), each
# with the API's word for it. The torch engine sends END_ID for the end token, STOP_WORDS
# for a stop word or a completed guide, 3 at max_tokens, 5 for a stopped request.
FINISH_END_ID, FINISH_STOP_WORDS = 1, 2
FINISH_REASONS = {1: "stop", 2: "stop", 3: "length", 4: "length", 5: "cancelled"}
FINISH_REASON_CODES = {"stop": FINISH_STOP_WORDS, "length": 3, "cancelled": 5}
# The end token is counted (num_output_tokens) but never in output_ids, as TensorRT-LLM
# leaves it out. Its log probability is not lost: on a last response whose finish_reason
# is FINISH_END_ID, output_log_probs (and top_log_probs, top_token_ids) hold one entry
# more than output_ids, the end token's, as vLLM's answer holds it (evaluation harnesses
# read it). A repository without finish_reason (TensorRT-LLM's) never sends it.

# TensorRT-LLM's guided decoding inputs (its names and shapes, on the ensemble and the
# tensorrt_llm step alike) and its guide types (tritonllm/guided.py compiles them).
GUIDED_DECODING_GUIDE_TYPE = _opt("guided_decoding_guide_type", "STRING", 1)
GUIDED_DECODING_GUIDE = _opt("guided_decoding_guide", "STRING", 1)
_GUIDED_DECODING_INPUTS = (GUIDED_DECODING_GUIDE_TYPE, GUIDED_DECODING_GUIDE)
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
LORA_TASK_ID = _opt("lora_task_id", "UINT64", 1)
LORA_WEIGHTS = _opt("lora_weights", "FP16", -1, -1)
LORA_CONFIG = _opt("lora_config", "INT32", -1, 3)
_LORA_INPUTS = (LORA_TASK_ID, LORA_WEIGHTS, LORA_CONFIG)

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

# The ensemble's and the tensorrt_llm step's sampling inputs of the same name.
END_ID = _opt("end_id", "INT32", 1)
PAD_ID = _opt("pad_id", "INT32", 1)
BEAM_WIDTH = _opt("beam_width", "INT32", 1)
TEMPERATURE = _opt("temperature", "FP32", 1)
REPETITION_PENALTY = _opt("repetition_penalty", "FP32", 1)
MIN_TOKENS = _opt("min_tokens", "INT32", 1)
PRESENCE_PENALTY = _opt("presence_penalty", "FP32", 1)
FREQUENCY_PENALTY = _opt("frequency_penalty", "FP32", 1)
SEED = _opt("seed", "UINT64", 1)
EXCLUDE_INPUT_IN_OUTPUT = _opt("exclude_input_in_output", "BOOL", 1)
RETURN_LOG_PROBS = _opt("return_log_probs", "BOOL", 1)
RETURN_NUM_INPUT_TOKENS = _opt("return_num_input_tokens", "BOOL", 1)
RETURN_NUM_OUTPUT_TOKENS = _opt("return_num_output_tokens", "BOOL", 1)

# The ensemble's own inputs.
TEXT_INPUT = _t("text_input", "STRING", 1)
MAX_TOKENS = _t("max_tokens", "INT32", 1)
BAD_WORDS = _opt("bad_words", "STRING", -1)
STOP_WORDS = _opt("stop_words", "STRING", -1)
TOP_K = _opt("top_k", "INT32", 1)
TOP_P = _opt("top_p", "FP32", 1)
LENGTH_PENALTY = _opt("length_penalty", "FP32", 1)
STREAM = _opt("stream", "BOOL", 1)
EMBEDDING_BIAS_WORDS = _opt("embedding_bias_words", "STRING", -1)
EMBEDDING_BIAS_WEIGHTS = _opt("embedding_bias_weights", "FP32", -1)
EMBEDDING_BIAS_TOKEN_IDS = _opt("embedding_bias_token_ids", "INT32", -1)

# The tensorrt_llm step's own inputs (input_ids: the ensemble's is optional).
INPUT_IDS = _t("input_ids", "INT32", -1)
INPUT_LENGTHS = _t("input_lengths", "INT32", 1)
REQUEST_OUTPUT_LEN = _t("request_output_len", "INT32", 1)
STOP_WORDS_LIST = _opt("stop_words_list", "INT32", 2, -1)
BAD_WORDS_LIST = _opt("bad_words_list", "INT32", 2, -1)
RUNTIME_TOP_K = _opt("runtime_top_k", "INT32", 1)
RUNTIME_TOP_P = _opt("runtime_top_p", "FP32", 1)
LEN_PENALTY = _opt("len_penalty", "FP32", 1)
STREAMING = _opt("streaming", "BOOL", 1)
EMBEDDING_BIAS = _opt("embedding_bias", "FP32", -1)
STOP = _opt("stop", "BOOL", 1)

# Outputs: the tensorrt_llm step's, which the ensemble passes on, and each one's own.
OUTPUT_IDS = _t("output_ids", "INT32", -1, -1)
CUM_LOG_PROBS = _t("cum_log_probs", "FP32", -1)
OUTPUT_LOG_PROBS = _t("output_log_probs", "FP32", -1, -1)
NUM_INPUT_TOKENS = _t("num_input_tokens", "INT32", 1)
NUM_OUTPUT_TOKENS = _t("num_output_tokens", "INT32", 1)
BATCH_INDEX = _t("batch_index", "INT32", 1)
TEXT_OUTPUT = _t("text_output", "STRING", -1)
SEQUENCE_LENGTH = _t("sequence_length", "INT32", -1)

ENSEMBLE_INPUTS = (
    TEXT_INPUT,
    MAX_TOKENS,
    # A prompt already tokenized (an extension of NVIDIA's ensemble): taken as it is,
    # instead of text_input (sent empty), with no special tokens added.
    replace(INPUT_IDS, optional=True),
    BAD_WORDS,
    STOP_WORDS,
    END_ID,
    PAD_ID,
    TOP_K,
    TOP_P,
    TEMPERATURE,
    LENGTH_PENALTY,
    REPETITION_PENALTY,
    MIN_TOKENS,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    SEED,
    BEAM_WIDTH,
    STREAM,
    EXCLUDE_INPUT_IN_OUTPUT,
    RETURN_LOG_PROBS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    # Per-token biases added to the logits before sampling (OpenAI's logit_bias):
    # upstream's words and weights, or (ours) token ids with the weights.
    EMBEDDING_BIAS_WORDS,
    EMBEDDING_BIAS_WEIGHTS,
    EMBEDDING_BIAS_TOKEN_IDS,
    # Guided decoding (structured outputs), as TensorRT-LLM's backends take it: one of
    # GUIDE_TYPES and the guide's text (a JSON Schema, a regex, an EBNF grammar, an
    # XGrammar structural tag; nothing for "json"). Straight to the tensorrt_llm step.
    *_GUIDED_DECODING_INPUTS,
    # LoRA adapters, as TensorRT-LLM's backends take them: straight to tensorrt_llm.
    *_LORA_INPUTS,
    *_ENGINE_EXTENSION_INPUTS,
)

ENSEMBLE_OUTPUTS = (
    TEXT_OUTPUT,
    # The generated ids, as tensorrt_llm returns them (an extension of NVIDIA's
    # ensemble): the API names each token of a ``logprobs`` answer with them.
    OUTPUT_IDS,
    CUM_LOG_PROBS,
    OUTPUT_LOG_PROBS,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    BATCH_INDEX,
    *_ENGINE_EXTENSION_OUTPUTS,
)

# The preprocessing's and postprocessing's tensors (upstream's capitals), prefixed with
# their model: several share a name with an ensemble or tensorrt_llm tensor.
PRE_QUERY = _t("QUERY", "STRING", 1)
PRE_REQUEST_OUTPUT_LEN = _t("REQUEST_OUTPUT_LEN", "INT32", 1)  # an input and an output
PRE_INPUT_IDS = _opt("INPUT_IDS", "INT32", -1)
PRE_BAD_WORDS_DICT = _opt("BAD_WORDS_DICT", "STRING", -1)
PRE_STOP_WORDS_DICT = _opt("STOP_WORDS_DICT", "STRING", -1)
PRE_END_ID = _opt("END_ID", "INT32", 1)
PRE_PAD_ID = _opt("PAD_ID", "INT32", 1)
PRE_EMBEDDING_BIAS_WORDS = _opt("EMBEDDING_BIAS_WORDS", "STRING", -1)
PRE_EMBEDDING_BIAS_WEIGHTS = _opt("EMBEDDING_BIAS_WEIGHTS", "FP32", -1)
PRE_EMBEDDING_BIAS_TOKEN_IDS = _opt("EMBEDDING_BIAS_TOKEN_IDS", "INT32", -1)
PRE_INPUT_ID = _t("INPUT_ID", "INT32", -1)
PRE_REQUEST_INPUT_LEN = _t("REQUEST_INPUT_LEN", "INT32", 1)
PRE_BAD_WORDS_IDS = _t("BAD_WORDS_IDS", "INT32", 2, -1)
PRE_STOP_WORDS_IDS = _t("STOP_WORDS_IDS", "INT32", 2, -1)
PRE_OUT_END_ID = _t("OUT_END_ID", "INT32", 1)
PRE_OUT_PAD_ID = _t("OUT_PAD_ID", "INT32", 1)
# [vocabulary] floats, or [0] when the request has no bias (as upstream).
PRE_EMBEDDING_BIAS = _t("EMBEDDING_BIAS", "FP32", -1)
POST_TOKENS_BATCH = _t("TOKENS_BATCH", "INT32", -1, -1)
POST_SEQUENCE_LENGTH = _t("SEQUENCE_LENGTH", "INT32", -1)
POST_OUTPUT = _t("OUTPUT", "STRING", -1)

PREPROCESSING_INPUTS = (
    PRE_QUERY,
    PRE_REQUEST_OUTPUT_LEN,
    PRE_INPUT_IDS,
    PRE_BAD_WORDS_DICT,
    PRE_STOP_WORDS_DICT,
    PRE_END_ID,
    PRE_PAD_ID,
    PRE_EMBEDDING_BIAS_WORDS,
    PRE_EMBEDDING_BIAS_WEIGHTS,
    PRE_EMBEDDING_BIAS_TOKEN_IDS,
)

PREPROCESSING_OUTPUTS = (
    PRE_INPUT_ID,
    PRE_REQUEST_INPUT_LEN,
    PRE_BAD_WORDS_IDS,
    PRE_STOP_WORDS_IDS,
    PRE_REQUEST_OUTPUT_LEN,
    PRE_OUT_END_ID,
    PRE_OUT_PAD_ID,
    PRE_EMBEDDING_BIAS,
)

TENSORRT_LLM_INPUTS = (
    INPUT_IDS,
    INPUT_LENGTHS,
    REQUEST_OUTPUT_LEN,
    END_ID,
    PAD_ID,
    STOP_WORDS_LIST,
    BAD_WORDS_LIST,
    BEAM_WIDTH,
    RUNTIME_TOP_K,
    RUNTIME_TOP_P,
    TEMPERATURE,
    LEN_PENALTY,
    REPETITION_PENALTY,
    MIN_TOKENS,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    SEED,
    STREAMING,
    EXCLUDE_INPUT_IN_OUTPUT,
    RETURN_LOG_PROBS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    EMBEDDING_BIAS,
    STOP,
    *_GUIDED_DECODING_INPUTS,
    *_LORA_INPUTS,
    *_ENGINE_EXTENSION_INPUTS,
)

TENSORRT_LLM_OUTPUTS = (
    OUTPUT_IDS,
    SEQUENCE_LENGTH,
    CUM_LOG_PROBS,
    OUTPUT_LOG_PROBS,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    BATCH_INDEX,
    *_ENGINE_EXTENSION_OUTPUTS,
)

POSTPROCESSING_INPUTS = (POST_TOKENS_BATCH, POST_SEQUENCE_LENGTH)

POSTPROCESSING_OUTPUTS = (POST_OUTPUT,)

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

EMBEDDINGS_TEXT = _t("text", "STRING", 1)
EMBEDDINGS_VECTOR = _t("embedding", "FP32", -1)  # L2-normalised (384 floats: MiniLM-L6)
EMBEDDINGS_NUM_TOKENS = _t("num_tokens", "INT32", 1)  # tokens read, special ones included

EMBEDDINGS_INPUTS = (EMBEDDINGS_TEXT,)

EMBEDDINGS_OUTPUTS = (EMBEDDINGS_VECTOR, EMBEDDINGS_NUM_TOKENS)

EMBEDDING_MODELS = {EMBEDDINGS: (EMBEDDINGS_INPUTS, EMBEDDINGS_OUTPUTS)}

ALL_MODELS = {**MODELS, **EMBEDDING_MODELS}


# Where the Triton replica tells its engine to publish its KV cache events
# (routing: kv_aware), "PUB,REPLAY" ZMQ endpoints: set in the replica's environment
# before Triton starts, so its Python stubs inherit it (tritonllm/engine/kv_events.py).
KV_EVENTS_ENDPOINTS_ENV = "TRITONLLM_KV_EVENTS_ENDPOINTS"

# The most alternatives per token an engine request may ask for (as many as OpenAI's
# top_logprobs bound, which the API holds: serve/api/openai/fields.py).
MAX_TOP_LOG_PROBS = 20


def tensor(model: str, name: str) -> Tensor:
    """Look up one tensor of ``model`` (of either repository) by name, inputs first."""
    inputs, outputs = ALL_MODELS[model]
    for spec in (*inputs, *outputs):
        if spec.name == name:
            return spec
    raise KeyError(f"{model} has no tensor {name!r}")
