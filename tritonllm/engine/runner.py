"""The Hugging Face causal LM behind the engine: load, prefill, decode one step."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


class CausalLMRunner:
    """Runs one sequence's forward passes; the KV cache is transformers' own."""

    def __init__(self, engine_dir: str | Path, device: str = "auto", dtype: str = "auto"):
        from transformers import AutoConfig, AutoModelForCausalLM

        engine_dir = Path(engine_dir)
        if not (engine_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"engine_dir {engine_dir} has no config.json: run `make engines` "
                "or pass MODEL=<hf checkpoint dir>"
            )
        self.device = pick_device(device)
        torch_dtype = _DTYPES.get(dtype) or (
            torch.float32 if self.device.type == "cpu" else torch.bfloat16
        )
        self.config = AutoConfig.from_pretrained(engine_dir, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            engine_dir, dtype=torch_dtype, local_files_only=True
        ).to(self.device)
        self.model.eval()
        # transformers 5.2x renamed past_key_values to cache; the NGC images ship older ones.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.vocab_size = int(self.config.vocab_size)
        self.max_position_embeddings = int(
            getattr(self.config, "max_position_embeddings", 0) or 2048
        )
        log.info("loaded %s on %s (%s)", engine_dir, self.device, torch_dtype)

    @torch.inference_mode()
    def prefill(self, input_ids: list[int]):
        """Logits after the whole prompt, and the KV cache that holds it."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        return out.logits[0, -1], self._cache_of(out)

    @torch.inference_mode()
    def decode(self, token_id: int, past_key_values):
        """Logits after one more token, extending ``past_key_values`` in place."""
        ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: past_key_values})
        return out.logits[0, -1], self._cache_of(out)

    def _cache_of(self, out):
        return getattr(out, self._cache_arg)
