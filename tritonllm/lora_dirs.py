"""The contract's LoRA tensors as PEFT adapter directories, for engines that load
adapters from a path (TensorRT-LLM's LLM API: ``LoRARequest(name, id, path)``).

A request names its adapter by ``lora_task_id``; its first request also carries the
packed weights (:mod:`tritonllm.lora`). :class:`AdapterDirectories` writes each task
id's adapter once, as a PEFT directory under a cache folder of its own, and answers
later requests with the id alone from there; an id it does not hold is TensorRT-LLM's
cache miss (:func:`tritonllm.contract.lora_cache_miss`), so the caller resends the
weights, as it does for the C++ backend.

The packed out weights are already scaled by ``alpha / r``, so the directory says
``lora_alpha = r`` (PEFT's scale is then 1). Modules of smaller rank are zero-padded to
the adapter's largest, which leaves each product ``B @ A`` unchanged.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from tritonllm.contract import lora_cache_miss
from tritonllm.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    LoraTensors,
    ModuleDelta,
    check_fits,
    unpack,
)

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def peft_key(layer: int, module: str, side: str) -> str:
    """PEFT's name for a Llama-style model's LoRA weight (``side``: ``A`` or ``B``)."""
    block = "self_attn" if module in _ATTENTION else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{side}.weight"


def write_peft_dir(
    tensors: LoraTensors,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    path: Path,
    base_model: str = "",
) -> None:
    """Write ``tensors`` as a PEFT adapter (``adapter_config.json``,
    ``adapter_model.safetensors``) into ``path``, checked against the model's module
    ``shapes`` (``(in, out)`` by Hugging Face name) first."""
    deltas = unpack(tensors, shapes, num_layers)
    if not deltas:
        raise AdapterError("adapter has no LoRA weights")
    _write_deltas(deltas, path, base_model)


def _write_deltas(deltas: list[ModuleDelta], path: Path, base_model: str) -> None:
    from safetensors.numpy import save_file

    rank = max(d.a.shape[0] for d in deltas)
    state = {}
    for d in deltas:
        a = np.zeros((rank, d.a.shape[1]), dtype=np.float16)
        b = np.zeros((d.b.shape[0], rank), dtype=np.float16)
        a[: d.a.shape[0]], b[:, : d.b.shape[1]] = d.a, d.b
        state[peft_key(d.layer, d.module, "A")] = a
        state[peft_key(d.layer, d.module, "B")] = b
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": rank,  # B arrives scaled by alpha / r already
        "target_modules": sorted({d.module for d in deltas}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / ADAPTER_WEIGHTS))
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))


class AdapterDirectories:
    """Task id -> the PEFT directory its adapter was written to, at most ``capacity``
    of them (the least recently used one's directory is removed past that: its id is
    then a cache miss again). Thread-safe."""

    def __init__(
        self,
        root: Path,
        shapes: dict[str, tuple[int, int]],
        num_layers: int,
        max_rank: int,
        capacity: int,
        base_model: str = "",
    ):
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._shapes = shapes
        self._num_layers = num_layers
        self._max_rank = max_rank
        self._capacity = max(1, capacity)
        self._base_model = base_model
        self._paths: OrderedDict[int, Path] = OrderedDict()
        self._lock = threading.Lock()

    def path(self, task_id: int, tensors: LoraTensors | None) -> Path:
        """The adapter directory for ``task_id``, written from ``tensors`` on first use.

        Raises :class:`~tritonllm.lora.AdapterError`: the id alone and not held
        (``lora_cache_miss``), or an adapter that does not fit this model.
        A task id names one adapter: weights sent again for a held id are not rewritten.
        """
        with self._lock:
            held = self._paths.get(task_id)
            if held is not None:
                self._paths.move_to_end(task_id)
                return held
            if tensors is None:
                raise AdapterError(lora_cache_miss(task_id))
            # The rank limit (lora.max_rank in build_engines/trtllm.yaml) and the
            # shapes, as the replica and the torch engine check them.
            deltas = check_fits(tensors, self._shapes, self._num_layers, self._max_rank)
            path = self._root / f"task-{task_id}"
            partial = self._root / f".task-{task_id}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            try:
                _write_deltas(deltas, partial, self._base_model)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            shutil.rmtree(path, ignore_errors=True)
            partial.rename(path)  # whole or absent: the engine never reads half a write
            self._paths[task_id] = path
            while len(self._paths) > self._capacity:
                _, evicted = self._paths.popitem(last=False)
                shutil.rmtree(evicted, ignore_errors=True)
            return path

    def __contains__(self, task_id: int) -> bool:
        with self._lock:
            return task_id in self._paths

    def __len__(self) -> int:
        with self._lock:
            return len(self._paths)
