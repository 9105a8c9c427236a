"""Automatic prefix caching: keys and values of prompt prefixes, kept across requests.

Chat and agent traffic resends the same long prefix every turn (system prompt, tools,
the conversation so far). The cache keeps the keys and values of fixed-size blocks of
tokens, each block named by the whole prefix up to its end, so that an admitted
sequence copies its longest cached prefix into its slot and prefills only the rest:
vLLM's automatic prefix caching and TensorRT-LLM's KV cache block reuse, on the
engine's slot-contiguous cache.

Why copies instead of a paged cache: the running batch keeps each sequence's keys and
values contiguous in its own row (``kv_cache.SlotKVCache``), which is what lets decode
read one strided view per layer with no gather. Copying a cached prefix into the row
costs one memory copy of the prefix, far less than prefilling it again, and it
means no running sequence ever reads a block of this pool: the pool can evict
any block, at any time, without a reference count.

A block's key is ``(parent id, its tokens)``: the parent's id stands for the whole
prefix before it, so equal keys mean equal prefixes, as a chained hash does, but with
no collision to fear (the dict compares the tokens themselves). Ids are never reused,
so the children of an evicted block can no longer be reached and age out in turn.
A first block's parent is its chain's root: ``ROOT`` for the base model, a LoRA
adapter's own root for its requests, whose keys and values differ from the base's
for the same tokens (TensorRT-LLM keys its block reuse by the LoRA task id too).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tritonllm.engine.kv_cache import SlotKVCache

if TYPE_CHECKING:
    from tritonllm.engine.kv_events import KVEventPublisher

ROOT = 0  # the parent id of a first block of the base model's sequences


@dataclass
class _Block:
    key: tuple
    uid: int  # never reused: stands for the prefix that ends with this block
    index: int  # its row in the pool's tensors


class PrefixCache:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens, least recently used
    evicted first. Used by the engine thread only (no locking)."""

    def __init__(self, cache: SlotKVCache, num_blocks: int, block_size: int = 16):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a prefix cache needs blocks: {num_blocks} of {block_size} tokens")
        self.block_size = block_size
        self.num_blocks = num_blocks
        heads, dim = cache.kv_shape
        # torch.empty: pages are touched only when a block is first written.
        shape = (num_blocks, heads, block_size, dim)
        self._keys = [cache.new_empty(shape) for _ in range(cache.num_layers)]
        self._values = [cache.new_empty(shape) for _ in range(cache.num_layers)]
        self._blocks: OrderedDict[tuple, _Block] = OrderedDict()  # least recent first
        self._free = list(range(num_blocks))
        self._uids = itertools.count(ROOT + 1)
        # Told of every block stored and evicted (kv_events.KVEventPublisher), if set.
        self.events: KVEventPublisher | None = None

    @classmethod
    def for_budget(cls, cache: SlotKVCache, budget_mb: float, block_size: int = 16):
        """As many blocks as ``budget_mb`` MiB hold; None when that is not one block."""
        num_blocks = int(budget_mb * 2**20) // (cache.bytes_per_token() * block_size)
        return cls(cache, num_blocks, block_size) if num_blocks else None

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    def match(self, tokens: list[int], root: Hashable = ROOT) -> list[_Block]:
        """The cached blocks of the longest cached prefix of ``tokens`` under ``root``,
        leaving the last token out (its logits are the prefill's point), and marks them
        recently used."""
        chain = []
        parent = root
        for block_tokens in self._split(tokens[:-1]):
            block = self._blocks.get((parent, block_tokens))
            if block is None:
                break
            chain.append(block)
            parent = block.uid
        self._touch(chain)
        return chain

    @torch.inference_mode()  # the slot rows may be inference tensors (grown in a forward)
    def load(self, cache: SlotKVCache, slot: int, chain: list[_Block]) -> int:
        """Copy ``chain`` (from :meth:`match`, this step) into columns ``[0, n)`` of
        ``slot``; returns n, the tokens now cached there."""
        if not chain:
            return 0
        length = len(chain) * self.block_size
        rows = torch.tensor([b.index for b in chain], device=self._keys[0].device)
        for layer, (keys, values) in enumerate(cache.row_views(slot, length)):
            keys.copy_(self._keys[layer][rows].transpose(0, 1).flatten(1, 2))
            values.copy_(self._values[layer][rows].transpose(0, 1).flatten(1, 2))
        return length

    @torch.inference_mode()
    def save(self, cache: SlotKVCache, slot: int, tokens: list[int], root: Hashable = ROOT) -> None:
        """Add the full blocks of ``tokens`` under ``root``, whose keys and values are
        columns ``[0, len(tokens))`` of ``slot``; blocks already cached are only marked
        used."""
        chain, new = [], []
        parent = root
        for position, block_tokens in enumerate(self._split(tokens)):
            key = (parent, block_tokens)
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)  # not the one _allocate evicts next
            else:
                if len(chain) >= self.num_blocks:  # never evict this prefix's own blocks
                    break
                block = _Block(key, next(self._uids), self._allocate())
                self._blocks[key] = block
                new.append((position, block.index))
            chain.append(block)
            parent = block.uid
        self._touch(chain)
        if new:
            self._copy_in(cache, slot, new, len(chain) * self.block_size)
            if self.events is not None:
                self._tell_stored(chain[-len(new) :], root)

    def _split(self, tokens: list[int]):
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            yield tuple(tokens[start : start + size])

    def _allocate(self) -> int:
        if self._free:
            return self._free.pop()
        _, evicted = self._blocks.popitem(last=False)
        if self.events is not None:
            self.events.removed(evicted.uid)
        return evicted.index

    def _tell_stored(self, new: list[_Block], root: Hashable) -> None:
        """The new blocks are the chain's tail (a block missing makes every block after
        it new: its key holds the missing one's id)."""
        parent = new[0].key[0]
        self.events.stored(parent, [(block.uid, block.key[1]) for block in new], root)

    def _touch(self, chain: list[_Block]) -> None:
        """Most recent last, deepest block first: leaves are evicted before the
        prefixes they extend (a parent gone makes its children unreachable)."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)

    def _copy_in(self, cache: SlotKVCache, slot: int, new: list[tuple[int, int]], length: int):
        positions = torch.tensor([p for p, _ in new])
        rows = torch.tensor([i for _, i in new], device=self._keys[0].device)
        for layer, (keys, values) in enumerate(cache.row_views(slot, length)):
            # [heads, blocks * size, dim] -> [blocks, heads, size, dim]
            by_block = keys.unflatten(1, (-1, self.block_size)).transpose(0, 1)
            self._keys[layer][rows] = by_block[positions]
            by_block = values.unflatten(1, (-1, self.block_size)).transpose(0, 1)
            self._values[layer][rows] = by_block[positions]
