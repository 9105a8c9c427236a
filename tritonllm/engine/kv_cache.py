"""The running batch's KV cache: one preallocated row ("slot") per sequence.

transformers' ``DynamicCache`` appends with ``torch.cat`` (a copy of the whole
cache on every decode step) and can hold sequences of different lengths only by
padding them to a common one. Here every sequence keeps its own row: prefill
writes the prompt's keys and values at columns ``[0, len)``, each decode step
writes one column per row in place, and attention reads a view of the first
``width`` columns under a mask that hides each row's columns past its own
length. Joining and leaving the batch copy one row, never the batch.

Written against the transformers 5 ``Cache`` interface: the model calls
``update(key_states, value_states, layer_idx)`` once per layer and forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


@dataclass
class _Plan:
    """What the next forward writes: a prefill of some slots, or one decode step."""

    slots: torch.Tensor  # row of each batch entry of the forward
    columns: torch.Tensor | None = None  # decode: the column each row writes
    width: int = 0  # columns attention reads (decode: max column + 1)
    # prefill after a cached prefix: row i's new tokens start at column starts[i] and
    # are lengths[i] long (the rest of the forward's width is padding)
    starts: list[int] | None = None
    lengths: list[int] | None = None


class SlotKVCache(Cache):
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_len: int = 256,
    ):
        super().__init__(layers=[])
        self.max_len = max_len
        shape = (num_slots, num_kv_heads, min(initial_len, max_len), head_dim)
        self._keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._values = [torch.zeros_like(k) for k in self._keys]
        self._plan: _Plan | None = None

    @classmethod
    def for_model(cls, model, num_slots: int, max_len: int, initial_len: int = 256) -> SlotKVCache:
        config = model.config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_slots=num_slots,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            max_len=max_len,
            dtype=model.dtype,
            device=model.device,
            initial_len=initial_len,
        )

    @property
    def capacity(self) -> int:
        return self._keys[0].shape[2]

    @property
    def num_layers(self) -> int:
        return len(self._keys)

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(key/value heads, head dim)."""
        return self._keys[0].shape[1], self._keys[0].shape[3]

    def bytes_per_token(self) -> int:
        heads, dim = self.kv_shape
        return 2 * self.num_layers * heads * dim * self._keys[0].element_size()

    def new_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self._keys[0].new_empty(shape)

    def row_views(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, writable views of columns ``[0, length)`` of row ``slot``."""
        self._reserve(length)
        return [
            (k[slot, :, :length], v[slot, :, :length])
            for k, v in zip(self._keys, self._values, strict=True)
        ]

    def plan_prefill(
        self,
        slots: list[int],
        length: int,
        starts: list[int] | None = None,
        lengths: list[int] | None = None,
    ) -> None:
        """The next forward fills columns ``[0, length)`` of ``slots``; or, with
        ``starts``, columns ``[starts[i], starts[i] + lengths[i])`` of ``slots[i]``,
        whose columns before ``starts[i]`` hold a cached prefix."""
        rows = torch.tensor(slots, device=self._keys[0].device)
        if starts is None:
            self._reserve(length)
            self._plan = _Plan(rows)
            return
        width = max(s + n for s, n in zip(starts, lengths, strict=True))
        self._reserve(width)
        self._plan = _Plan(rows, width=width, starts=starts, lengths=lengths)

    def plan_decode(self, columns: torch.Tensor) -> None:
        """The next forward writes row ``i`` (slots ``0..n-1``) at ``columns[i]``."""
        width = int(columns.max()) + 1
        self._reserve(width)
        rows = torch.arange(len(columns), device=columns.device)
        self._plan = _Plan(rows, columns, width)

    @torch.inference_mode()
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` columns of row ``src`` into row ``dst``."""
        for k, v in zip(self._keys, self._values, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        plan, keys, values = self._plan, self._keys[layer_idx], self._values[layer_idx]
        if plan.starts is not None:
            return self._update_after_prefix(plan, keys, values, key_states, value_states)
        if plan.columns is None:  # prefill: the new states are the whole context
            length = key_states.shape[2]
            keys[plan.slots, :, :length] = key_states
            values[plan.slots, :, :length] = value_states
            return key_states, value_states
        keys[plan.slots, :, plan.columns] = key_states[:, :, 0]
        values[plan.slots, :, plan.columns] = value_states[:, :, 0]
        n = len(plan.slots)
        return keys[:n, :, : plan.width], values[:n, :, : plan.width]

    @staticmethod
    def _update_after_prefix(plan, keys, values, key_states, value_states):
        """Write each row's real tokens after its prefix (rows start at different
        columns: a copy per row), then read the rows' first ``width`` columns; the
        padding's states are never written, and the mask hides what lies past a row."""
        for i, (start, n) in enumerate(zip(plan.starts, plan.lengths, strict=True)):
            slot = plan.slots[i]
            keys[slot, :, start : start + n] = key_states[i, :, :n]
            values[slot, :, start : start + n] = value_states[i, :, :n]
        return keys[plan.slots, :, : plan.width], values[plan.slots, :, : plan.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._plan is None or self._plan.columns is None else self._plan.width - 1

    def _reserve(self, length: int) -> None:
        """Grow every layer's buffer (doubling, up to max_len) to hold ``length`` columns."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"{length} cache columns requested, the cache holds {self.max_len}")
        new_len = min(max(2 * self.capacity, length), self.max_len)
        for buffers in (self._keys, self._values):
            for i, old in enumerate(buffers):
                grown = old.new_zeros(*old.shape[:2], new_len, old.shape[3])
                grown[:, :, : old.shape[2]] = old
                buffers[i] = grown
