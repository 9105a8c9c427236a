"""LoRA adapters in the torch engine: an adapter cache, and per-row deltas in one batch.

A request names its adapter by TensorRT-LLM's ``lora_task_id`` and carries the weights
(``lora_weights``/``lora_config``, tritonllm/lora.py's packing) on first use; the
:class:`AdapterCache` keeps them within a memory budget, least recently used evicted
first, never one that a queued or running sequence uses.

Requests with different adapters, and the base, share every prefill and decode
forward, as S-LoRA and Punica batch them: each targeted ``nn.Linear`` of the model is
wrapped by a :class:`LoraLinear` that adds ``(x @ A) @ B`` per row, from tensors that
stack the batch's adapters (zero-padded to the largest rank among them; the base's
entry is zeros). Prefill gathers each row's ``A`` and ``B`` and runs batched products
over its tokens; decode (one token a row) multiplies every row by all the batch's
adapters side by side and masks each row to its own, which reads each adapter once.
Two products per module either way, however many adapters the batch mixes. A
forward with no adapter row runs the base layers alone: the wrappers are installed
when the first adapter row runs, and then only check that no plan is set.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.contract import lora_cache_miss
from tritonllm.lora import AdapterError, LoraTensors, check_fits

# What PEFT targets on Llama-style models: the attention and MLP projections.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TARGET = re.compile(r"(?:^|\.)layers\.([0-9]+)\.(?:self_attn|mlp)\.([a-z_]+)$")
# Stacked tensors kept for the last few adapter sets (a step's prefill and its decode
# usually differ): a stable batch reuses them every decode step.
_STACKS_KEPT = 4
# Adapter uids, unique in the process: the stacks of a model's wrapped layers are kept
# by uid, whichever cache (engine) an adapter came from.
_UIDS = itertools.count(1)


class LoraCacheFull(RuntimeError):
    """Every cached adapter is in use and the new one does not fit (retry later)."""


def target_linears(model: nn.Module) -> dict[tuple[int, str], tuple[str, nn.Module]]:
    """The model's adapter-targetable linear layers by (layer, Hugging Face name): each
    one's qualified name and module (an ``nn.Linear``, or its wrapper once installed)."""
    found = {}
    for qualified, module in model.named_modules():
        match = _TARGET.search(qualified)
        if match and match[2] in TARGET_MODULES and isinstance(module, nn.Linear | LoraLinear):
            found[int(match[1]), match[2]] = (qualified, module)
    return found


@dataclass(eq=False)
class Adapter:
    """One cached adapter: per (layer, module) ``a`` ``[in, rank]`` and ``b``
    ``[rank, out]`` (scaled), in the model's dtype, on its device."""

    task_id: int
    uid: int  # never reused: a re-registered task id is a new adapter (prefix cache)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    users: int = 0  # queued and running sequences: it is not evicted while any

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @property
    def prefix_root(self) -> tuple:
        """Where its prompts' blocks hang in the prefix cache (apart from the base's); its
        task id names them in the KV cache events (kv_events.lora_of)."""
        return ("lora", self.uid, self.task_id)


class AdapterCache:
    """Adapters by task id within ``budget_bytes``; thread-safe (requests are submitted
    from Triton's threads, released by the engine's)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, int]],
        num_layers: int,
        max_rank: int,
        budget_bytes: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.shapes, self.num_layers = shapes, num_layers
        self.max_rank, self.budget_bytes = max_rank, budget_bytes
        self.dtype, self.device = dtype, device
        self._adapters: OrderedDict[int, Adapter] = OrderedDict()  # least recent first
        self._lock = threading.Lock()

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self._adapters.values())

    def __contains__(self, task_id: int) -> bool:
        with self._lock:
            return task_id in self._adapters

    def acquire(self, task_id: int, tensors: LoraTensors | None) -> Adapter:
        """The adapter of ``task_id``, held for a sequence until :meth:`release`. A
        cached id is only marked used (weights sent again change nothing); an unknown
        one is loaded from ``tensors``. Raises AdapterError (a client's bad adapter or
        TensorRT-LLM's cache miss) or LoraCacheFull."""
        with self._lock:
            adapter = self._adapters.get(task_id)
            if adapter is not None:
                return self._hold(adapter)
        if tensors is None:
            raise AdapterError(lora_cache_miss(task_id))
        loaded = self._load(task_id, tensors)  # outside the lock: the unpacking is slow
        with self._lock:
            adapter = self._adapters.get(task_id)  # another request loaded it meanwhile
            if adapter is None:
                self._make_room(loaded.nbytes)
                adapter = self._adapters[task_id] = loaded
            return self._hold(adapter)

    def release(self, adapter: Adapter) -> None:
        with self._lock:
            adapter.users -= 1

    def _hold(self, adapter: Adapter) -> Adapter:
        adapter.users += 1
        self._adapters.move_to_end(adapter.task_id)
        return adapter

    def _make_room(self, nbytes: int) -> None:
        if nbytes > self.budget_bytes:
            raise AdapterError(
                f"adapter takes {nbytes} bytes, more than the whole adapter cache "
                f"(lora_cache_host_memory_bytes {self.budget_bytes})"
            )
        resident = sum(a.nbytes for a in self._adapters.values())
        idle = [a for a in self._adapters.values() if a.users == 0]  # least recent first
        while resident + nbytes > self.budget_bytes:
            if not idle:
                # TensorRT-LLM's words (its PEFT cache), which callers match.
                raise LoraCacheFull("Cache is full. There are no done tasks to evict")
            evicted = idle.pop(0)
            del self._adapters[evicted.task_id]
            resident -= evicted.nbytes

    def _load(self, task_id: int, tensors: LoraTensors) -> Adapter:
        # The rank limit, and the shapes: an adapter of another base is refused.
        deltas = check_fits(tensors, self.shapes, self.num_layers, self.max_rank)
        weights = {}
        for d in deltas:
            if (d.layer, d.module) in weights:
                raise AdapterError(f"layer {d.layer} {d.module} appears twice in lora_config")
            a = torch.from_numpy(d.a.T.copy()).to(self.device, self.dtype)
            b = torch.from_numpy(d.b.T.copy()).to(self.device, self.dtype)
            weights[d.layer, d.module] = (a, b)
        return Adapter(task_id, next(_UIDS), weights)


class LoraLinear(nn.Module):
    """A targeted linear layer: the base layer, plus each row's delta while the
    engine has set a plan for the forward."""

    def __init__(self, base: nn.Linear, key: tuple[int, str], owner: BatchedLora):
        super().__init__()
        self.base = base
        self.key = key
        self._owner = [owner]  # in a list: not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The base layer's own function, not its module call: a forward without adapter
        # rows then costs what it did before the wrapping.
        out = F.linear(x, self.base.weight, self.base.bias)
        plan = self._owner[0].plan
        return out if plan is None else plan.add_delta(self.key, x, out)


@dataclass
class _Stacks:
    """The adapters of a set stacked per (layer, module): ``a`` ``[in, n, r]`` and
    ``b`` ``[n, r, out]``, ``r`` the set's largest rank for that module, adapter 0 all
    zeros when the set has base rows; then ``a.flatten(1)`` and ``b.flatten(0, 1)``:
    every adapter side by side (views: ``a``'s layout makes them so)."""

    index: dict[int | None, int]  # adapter uid (None: the base) -> its index
    tensors: dict[tuple[int, str], tuple[torch.Tensor, ...]] = field(default_factory=dict)


@dataclass
class _Plan:
    rows: torch.Tensor  # [rows] each row's index into the stacks
    stacks: _Stacks
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by rank

    def add_delta(self, key, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        pair = self.stacks.tensors.get(key)
        if pair is None:  # no adapter of the batch targets this module
            return out
        a, b, a_flat, b_flat = pair
        rows = x.shape[0]
        if x.shape[1] == 1:
            # Decode: every row through all of the batch's adapters side by side, masked
            # to its own. Two plain products read each adapter once; gathering per row
            # would copy an adapter once per row of it (on CPU, 2x slower at 16 rows).
            low = torch.mm(x.reshape(rows, -1), a_flat).mul_(self._mask(a.shape[2], x.dtype))
            out.view(rows, -1).addmm_(low, b_flat)
            return out
        # Prefill: each row's adapter gathered, then batched products over its tokens
        # (the side-by-side products would cost every adapter's FLOPs per token).
        low = torch.bmm(x, a.transpose(0, 1).index_select(0, self.rows))  # [rows, tokens, r]
        return out.baddbmm_(low, b.index_select(0, self.rows))

    def _mask(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, n * rank]``: 1 on each row's own adapter's columns."""
        mask = self.masks.get(rank)
        if mask is None:
            count = len(self.stacks.index)
            own = torch.nn.functional.one_hot(self.rows, count).to(dtype)
            mask = self.masks[rank] = own.repeat_interleave(rank, dim=1)
        return mask


class BatchedLora:
    """Wraps a model's targeted layers and sets, per forward, which adapter each row
    uses. Used by the engine thread only."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.plan: _Plan | None = None
        self._installed = False
        self._stacks: OrderedDict[tuple, _Stacks] = OrderedDict()

    def module_shapes(self) -> tuple[dict[str, tuple[int, int]], int]:
        """Each targeted module's ``(in, out)`` sizes, and the number of layers."""
        linears = target_linears(self.model)
        shapes = {}
        for (_, name), (_, module) in linears.items():
            base = module.base if isinstance(module, LoraLinear) else module
            shape = (base.in_features, base.out_features)
            if shapes.setdefault(name, shape) != shape:
                raise ValueError(f"{name} differs in shape between layers: not servable")
        return shapes, 1 + max(layer for layer, _ in linears) if linears else 0

    @contextmanager
    def rows(self, adapters: list[Adapter | None]):
        """Within the block, row ``i`` of a forward adds ``adapters[i]``'s deltas."""
        if not any(adapters):
            yield
            return
        self._install()
        stacks = self._stacks_for(adapters)
        rows = [stacks.index[a.uid if a else None] for a in adapters]
        device = next(self.model.parameters()).device
        self.plan = _Plan(torch.tensor(rows, device=device), stacks)
        try:
            yield
        finally:
            self.plan = None

    def _install(self) -> None:
        if self._installed:
            return
        for key, (qualified, linear) in target_linears(self.model).items():
            parent = self.model.get_submodule(qualified.rpartition(".")[0])
            setattr(parent, key[1], LoraLinear(linear, key, self))
        self._installed = True

    def _stacks_for(self, adapters: list[Adapter | None]) -> _Stacks:
        distinct = list({a.uid: a for a in adapters if a is not None}.values())
        has_base = any(a is None for a in adapters)
        key = (has_base, *sorted(a.uid for a in distinct))
        stacks = self._stacks.get(key)
        if stacks is None:
            stacks = self._stacks[key] = _stack(distinct, has_base)
            if len(self._stacks) > _STACKS_KEPT:
                self._stacks.popitem(last=False)
        self._stacks.move_to_end(key)
        return stacks


def _stack(adapters: list[Adapter], has_base: bool) -> _Stacks:
    offset = int(has_base)
    stacks = _Stacks({None: 0} if has_base else {})
    for i, adapter in enumerate(adapters):
        stacks.index[adapter.uid] = offset + i
    count = offset + len(adapters)
    for key in sorted({k for a in adapters for k in a.weights}):
        pairs = [(i, a.weights[key]) for i, a in enumerate(adapters) if key in a.weights]
        sample_a, sample_b = pairs[0][1]
        rank = max(a.shape[1] for _, (a, _) in pairs)
        a_stack = sample_a.new_zeros((sample_a.shape[0], count, rank))
        b_stack = sample_b.new_zeros((count, rank, sample_b.shape[1]))
        for i, (a, b) in pairs:
            a_stack[:, offset + i, : a.shape[1]] = a
            b_stack[offset + i, : b.shape[0]] = b
        stacks.tensors[key] = (a_stack, b_stack, a_stack.flatten(1), b_stack.flatten(0, 1))
    return stacks
