"""LoRA adapters in TensorRT-LLM's format: a PEFT adapter packed into the contract's
``lora_weights`` and ``lora_config`` tensors, and unpacked again by the torch engine.

The packing is TensorRT-LLM's (its ``hf_lora_convert.py``): one row per module and
layer, holding the in weights (PEFT's ``lora_A``, ``[D, Hi]``) flattened, then the out
weights (``lora_B``, ``[Ho, D]``) flattened and scaled by ``alpha / D`` (``alpha /
sqrt(D)`` for rsLoRA), zero-padded to the longest row; the config row is the module's
id, the layer and ``D``. Written here because TensorRT-LLM's converter needs
TensorRT-LLM installed, and the serving path packs adapters on CPU machines too.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import numpy as np

from tritonllm.contract import LORA_MODULE_IDS

# PEFT's (Hugging Face) module names on Llama-style models, and TensorRT-LLM's for them
# (its Llama calls gate_proj the MLP's h_to_4h and up_proj its gate).
HF_TO_TRTLLM_MODULES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h",
    "down_proj": "mlp_4h_to_h",
    "up_proj": "mlp_gate",
}
MODULE_ID_TO_HF = {LORA_MODULE_IDS[t]: hf for hf, t in HF_TO_TRTLLM_MODULES.items()}

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

_WEIGHT_KEY = re.compile(
    r".*\.layers\.([0-9]+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter this model cannot serve; the message says why (a client's 400)."""


@dataclass(frozen=True)
class LoraTensors:
    """An adapter as the contract carries it (without the batch dimension)."""

    weights: np.ndarray  # float16 [module-layers, row]
    config: np.ndarray  # int32 [module-layers, 3]: module id, layer, rank

    @property
    def max_rank(self) -> int:
        return int(self.config[:, 2].max())

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.config.nbytes


def pack_peft(adapter_config: dict, state: dict[str, np.ndarray]) -> LoraTensors:
    """A PEFT adapter (its ``adapter_config.json`` and its tensors by name) packed."""
    _check_peft_config(adapter_config)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in state.items():
        match = _WEIGHT_KEY.match(key)
        if match is None:
            raise AdapterError(f"adapter tensor {key!r} is not a LoRA A/B weight of a layer")
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in HF_TO_TRTLLM_MODULES:
            raise AdapterError(
                f"adapter targets {module!r}; served modules: {', '.join(HF_TO_TRTLLM_MODULES)}"
            )
        pairs.setdefault((layer, module), {})[side] = np.asarray(value, dtype=np.float32)
    if not pairs:
        raise AdapterError("adapter has no LoRA weights")
    alpha = float(adapter_config.get("lora_alpha") or adapter_config.get("r") or 1)
    rows, config = [], []
    for (layer, module), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: lora_A and lora_B are not both there")
        a, b = sides["A"], sides["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"layer {layer} {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                "do not make a low-rank pair"
            )
        rank = a.shape[0]
        scale = alpha / (math.sqrt(rank) if adapter_config.get("use_rslora") else rank)
        rows.append(np.concatenate([a.ravel(), (b * scale).ravel()]))
        config.append((LORA_MODULE_IDS[HF_TO_TRTLLM_MODULES[module]], layer, rank))
    width = max(len(r) for r in rows)
    weights = np.zeros((len(rows), width), dtype=np.float16)
    for i, row in enumerate(rows):
        weights[i, : len(row)] = row
    return LoraTensors(weights, np.asarray(config, dtype=np.int32))


def _check_peft_config(adapter_config: dict) -> None:
    kind = adapter_config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"adapter is a {kind} adapter; LoRA adapters are served")
    if adapter_config.get("use_dora"):
        raise AdapterError("DoRA adapters are not served (use_dora: true)")
    for key in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if adapter_config.get(key):
            raise AdapterError(f"adapter sets {key}; plain LoRA adapters are served")


@dataclass(frozen=True)
class ModuleDelta:
    """One module's adapter in one layer: ``y += (x @ a.T) @ b.T``."""

    layer: int
    module: str  # the Hugging Face module name (q_proj, ...)
    a: np.ndarray  # [rank, in]
    b: np.ndarray  # [out, rank], scaled


def unpack(tensors: LoraTensors, shapes: dict[str, tuple[int, int]], num_layers: int):
    """The module deltas of packed tensors, checked against the model: ``shapes`` maps
    each servable Hugging Face module name to its ``(in, out)`` sizes."""
    weights = np.asarray(tensors.weights)
    config = np.asarray(tensors.config)
    if weights.ndim != 2 or config.ndim != 2 or config.shape[1] != 3:
        raise AdapterError(
            f"lora_weights {list(weights.shape)} and lora_config {list(config.shape)}: "
            "expected [module-layers, row] and [module-layers, 3]"
        )
    if weights.shape[0] != config.shape[0]:
        raise AdapterError(
            f"lora_weights has {weights.shape[0]} rows, lora_config {config.shape[0]}"
        )
    deltas = []
    for row, (module_id, layer, rank) in zip(weights, config.tolist(), strict=True):
        module = MODULE_ID_TO_HF.get(module_id)
        if module is None or module not in shapes:
            raise AdapterError(f"LoRA module id {module_id} is not served by this model")
        if not 0 <= layer < num_layers:
            raise AdapterError(f"adapter has layer {layer}; the model has {num_layers} layers")
        fan_in, fan_out = shapes[module]
        need = rank * (fan_in + fan_out)
        if rank <= 0 or need > row.shape[0]:
            raise AdapterError(
                f"layer {layer} {module}: rank {rank} needs {need} weights for this model's "
                f"{fan_in}x{fan_out} projection, the row holds {row.shape[0]} (another base?)"
            )
        values = row.astype(np.float32)
        a = values[: rank * fan_in].reshape(rank, fan_in)
        b = values[rank * fan_in : need].reshape(fan_out, rank)
        deltas.append(ModuleDelta(layer, module, a, b))
    return deltas


def read_peft_dir(read_bytes) -> LoraTensors:
    """Pack the adapter whose files ``read_bytes(name)`` returns (a local directory or
    any fsspec URL: the caller chooses how to read)."""
    from safetensors.torch import load  # numpy has no bfloat16

    try:
        adapter_config = json.loads(read_bytes(ADAPTER_CONFIG))
    except FileNotFoundError:
        raise
    except ValueError as error:
        raise AdapterError(f"{ADAPTER_CONFIG} is not valid JSON: {error}") from None
    try:
        state = {k: v.float().numpy() for k, v in load(read_bytes(ADAPTER_WEIGHTS)).items()}
    except FileNotFoundError:
        raise AdapterError(f"adapter has no {ADAPTER_WEIGHTS}") from None
    except Exception as error:  # safetensors raises its own error types on corrupt data
        raise AdapterError(f"{ADAPTER_WEIGHTS} cannot be read: {error}") from None
    return pack_peft(adapter_config, state)


def llama_module_shapes(hf_config: dict) -> tuple[dict[str, tuple[int, int]], int]:
    """The ``(in, out)`` sizes of the modules an adapter may target on a Llama-style
    model (its Hugging Face ``config.json``), and the model's layer count: what
    :func:`unpack` and :func:`check_fits` check an adapter against."""
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inner = int(hf_config["intermediate_size"])
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }
    return shapes, int(hf_config["num_hidden_layers"])


def check_fits(
    tensors: LoraTensors, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int
) -> list[ModuleDelta]:
    """The adapter's module deltas, or :class:`AdapterError` naming why it does not fit
    a model (or the server's rank limit). Rows are zero-padded to the widest, so
    :func:`unpack` alone accepts an adapter of a smaller base; the widest row must fill
    the width exactly."""
    if len(tensors.config) == 0:
        raise AdapterError("lora_config has no rows: the adapter has no weights")
    if tensors.max_rank > max_rank:
        raise AdapterError(
            f"adapter has rank {tensors.max_rank}; this server serves ranks up to {max_rank}"
        )
    deltas = unpack(tensors, shapes, num_layers)
    widest = max(d.a.size + d.b.size for d in deltas)
    if widest != tensors.weights.shape[1]:
        raise AdapterError(
            f"adapter's weights are {tensors.weights.shape[1]} wide; for this model's module "
            f"shapes they would be {widest} (an adapter of another base model?)"
        )
    return deltas
