"""The Hugging Face causal LM behind the engine: load, prefill prompts, decode a batch."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import torch

from tritonllm.engine.kv_cache import SlotKVCache
from tritonllm.engine.lora import Adapter, AdapterCache, BatchedLora
from tritonllm.engine.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


class UnsupportedModel(ValueError):
    pass


class CausalLMRunner:
    """Forward passes of one model over a :class:`SlotKVCache`.

    Prefill runs the prompts admitted together in one right-padded forward;
    decode runs every running sequence in one forward with its own position and
    a mask over its own cache columns.
    """

    def __init__(self, engine_dir: str | Path, device: str = "auto", dtype: str = "auto"):
        from transformers import AutoConfig, AutoModelForCausalLM

        engine_dir = Path(engine_dir)
        if not (engine_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"engine_dir {engine_dir} has no config.json: run `make engines` "
                "or pass MODEL=<hf checkpoint dir>"
            )
        self.engine_dir = engine_dir  # the checkpoint, with its tokenizer (guided decoding)
        self.device = pick_device(device)
        torch_dtype = _DTYPES.get(dtype) or (
            torch.float32 if self.device.type == "cpu" else torch.bfloat16
        )
        self.config = AutoConfig.from_pretrained(engine_dir, local_files_only=True)
        _check_full_attention(self.config)
        self.model = AutoModelForCausalLM.from_pretrained(
            engine_dir, dtype=torch_dtype, local_files_only=True
        ).to(self.device)
        self.model.eval()
        self.vocab_size = int(self.config.vocab_size)
        self.max_position_embeddings = int(
            getattr(self.config, "max_position_embeddings", 0) or 2048
        )
        self.lora = BatchedLora(self.model)
        log.info("loaded %s on %s (%s)", engine_dir, self.device, torch_dtype)

    def new_cache(self, num_slots: int, max_len: int) -> SlotKVCache:
        return SlotKVCache.for_model(self.model, num_slots, max_len)

    def new_prefix_cache(
        self, cache: SlotKVCache, budget_mb: float, block_size: int
    ) -> PrefixCache | None:
        return PrefixCache.for_budget(cache, budget_mb, block_size)

    def new_adapter_cache(self, max_rank: int, budget_bytes: int) -> AdapterCache:
        shapes, num_layers = self.lora.module_shapes()
        return AdapterCache(
            shapes, num_layers, max_rank, budget_bytes, self.model.dtype, self.device
        )

    def _adapters(self, adapters: list[Adapter | None] | None):
        """Row ``i`` of the next forward with ``adapters[i]`` (None: the base)."""
        return self.lora.rows(adapters) if adapters else nullcontext()

    @torch.inference_mode()
    def prefill(
        self,
        cache: SlotKVCache,
        slots: list[int],
        prompts: list[list[int]],
        starts: list[int] | None = None,
        every_position: bool = False,
        adapters: list[Adapter | None] | None = None,
    ):
        """Logits ``[len(prompts), vocab]`` after each whole prompt; prompt ``i`` fills
        row ``slots[i]``, whose first ``starts[i]`` columns (if given) already hold
        the keys and values of its first ``starts[i]`` tokens (a cached prefix).
        ``every_position`` (one prompt): ``[1, new tokens, vocab]``, the logits after
        each of its tokens (a prompt's log probabilities). ``adapters[i]``: prompt
        ``i``'s LoRA adapter, or None for the base model.

        Prompts are right-padded into one forward (on 2 CPU cores 16 prompts of 32
        tokens run in about half the time of 16 forwards); the padding's keys and
        values land past each row's length, where decode overwrites or masks them.
        """
        if starts is not None and not any(starts):
            starts = None  # nothing cached: the cheaper forward with no cache reads
        news = [p[s:] for p, s in zip(prompts, starts, strict=True)] if starts else prompts
        lengths = [len(p) for p in news]
        width = max(lengths)
        ids = torch.zeros((len(news), width), dtype=torch.long)
        for row, new in enumerate(news):
            ids[row, : len(new)] = torch.tensor(new)
        last = torch.tensor(lengths) - 1
        keep = torch.unique(last)  # sorted: logits only where some prompt ends
        if every_position:
            keep = torch.arange(width)
        if starts:
            cache.plan_prefill(slots, width, starts, lengths)
            offsets = torch.tensor(starts, device=self.device)[:, None]
            positions = offsets + torch.arange(width, device=self.device)[None, :]
            mask = self._prefix_prefill_mask(
                positions, offsets[:, 0] + torch.tensor(lengths, device=self.device)
            )
        else:
            cache.plan_prefill(slots, width)
            positions = None
            mask = None if len(news) == 1 else self._prefill_mask(lengths, width)
        with self._adapters(adapters):
            out = self.model(
                input_ids=ids.to(self.device),
                position_ids=positions,
                attention_mask=mask,
                logits_to_keep=keep.to(self.device),
                cache=cache,
                use_cache=True,
            )
        if every_position:
            return out.logits
        return out.logits[torch.arange(len(news)), torch.searchsorted(keep, last)]

    @torch.inference_mode()
    def decode(
        self,
        cache: SlotKVCache,
        token_ids: list[int],
        positions: list[int],
        adapters: list[Adapter | None] | None = None,
    ):
        """Logits ``[rows, vocab]`` after one token per row; row ``i`` is slot ``i``.

        ``positions[i]`` is the number of tokens already cached for row ``i``: the
        new token's position and the cache column it is written to; ``adapters[i]``
        its LoRA adapter, or None for the base model.
        """
        columns = torch.tensor(positions, dtype=torch.long, device=self.device)
        cache.plan_decode(columns)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)[:, None]
        with self._adapters(adapters):
            out = self.model(
                input_ids=ids,
                position_ids=columns[:, None],
                attention_mask=self._decode_mask(columns, cache.get_seq_length() + 1),
                cache=cache,
                use_cache=True,
            )
        return out.logits[:, -1]

    def _prefill_mask(self, lengths: list[int], width: int) -> torch.Tensor:
        """Additive 4-D mask: causal, and no row reads its padding."""
        positions = torch.arange(width, device=self.device)
        causal = positions[None, :] <= positions[:, None]  # [query, key]
        real = positions[None, :] < torch.tensor(lengths, device=self.device)[:, None]
        allowed = causal[None, :, :] & real[:, None, :]
        return self._additive(~allowed)[:, None, :, :]

    def _prefix_prefill_mask(self, positions: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Additive 4-D mask after cached prefixes: the query at ``positions[i, j]``
        reads row ``i``'s columns up to itself and before ``ends[i]`` (prefix + prompt)."""
        columns = torch.arange(int(ends.max()), device=self.device)
        allowed = columns[None, None, :] <= positions[:, :, None]
        allowed &= columns[None, None, :] < ends.to(self.device)[:, None, None]
        return self._additive(~allowed)[:, None, :, :]

    def _decode_mask(self, columns: torch.Tensor, width: int) -> torch.Tensor:
        """Additive 4-D mask: row ``i`` reads its columns ``0..columns[i]`` only.

        transformers passes a 4-D mask to the attention as it is, so no model
        code second-guesses it; additive (not boolean) works for every attention
        implementation.
        """
        hidden = torch.arange(width, device=columns.device)[None, :] > columns[:, None]
        return self._additive(hidden)[:, None, None, :]

    def _additive(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = self.model.dtype
        mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
        return mask.masked_fill_(hidden, torch.finfo(dtype).min)


def _check_full_attention(config) -> None:
    """Sliding-window and recurrent layers need caches this engine does not have."""
    text = config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(text, "use_sliding_window", False):
        raise UnsupportedModel(
            f"model_type {config.model_type!r} has {sorted(kinds)} layers; the torch engine "
            "serves full-attention decoder models (llama, mistral, qwen2, gpt2, ...)"
        )
