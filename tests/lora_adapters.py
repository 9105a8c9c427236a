"""Small PEFT adapters of the default model, made in the test (nothing downloaded), and
their packed tensors; PEFT's own ``generate()`` is the reference an engine must equal.

Their weights are rounded to float16 values and ``lora_alpha / r`` is a power of two,
so the float16 ``lora_weights`` carry exactly PEFT's adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tritonllm.lora import LoraTensors, read_peft_dir

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: int  # alpha / rank: a power of two
    modules: tuple[str, ...]
    gain: float  # lora_B scaled up, so that greedy output visibly leaves the base's


SPECS = (
    AdapterSpec(4, 8, ("q_proj", "v_proj"), 4.0),
    AdapterSpec(8, 16, ALL_MODULES, 1.0),
    AdapterSpec(16, 16, ("gate_proj", "up_proj", "down_proj"), 2.0),
    AdapterSpec(12, 24, ("k_proj", "o_proj"), 4.0),
    AdapterSpec(6, 24, ("q_proj", "k_proj", "v_proj", "o_proj"), 2.0),
)


@dataclass
class PeftAdapter:
    task_id: int
    spec: AdapterSpec
    model: torch.nn.Module  # the PEFT model (base + this adapter), for reference outputs
    tensors: LoraTensors

    def lora_inputs(self, with_weights: bool = True) -> dict[str, np.ndarray]:
        """The contract's LoRA tensors of one request (batch dimension 1)."""
        values = {"lora_task_id": np.array([[self.task_id]], dtype=np.uint64)}
        if with_weights:
            values["lora_weights"] = self.tensors.weights[None]
            values["lora_config"] = self.tensors.config[None]
        return values


def make_adapter(
    base_dir: Path, spec: AdapterSpec, seed: int, out_dir: Path, task_id: int
) -> PeftAdapter:
    """A PEFT adapter of the checkpoint at ``base_dir`` with nonzero random weights,
    saved to ``out_dir`` and packed from there as a server would read it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.modules),
        lora_dropout=0.0,
        init_lora_weights=False,  # random B too: the adapter changes the output
    )
    model = get_peft_model(base, config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(spec.gain)
            if "lora_" in name:
                param.copy_(param.half().float())
    model.save_pretrained(out_dir)
    tensors = read_peft_dir(lambda name: (out_dir / name).read_bytes())
    return PeftAdapter(task_id, spec, model, tensors)


def make_adapters(base_dir: Path, out_dir: Path, first_task_id: int = 1) -> list[PeftAdapter]:
    return [
        make_adapter(base_dir, spec, seed, out_dir / f"adapter-{seed}", first_task_id + seed)
        for seed, spec in enumerate(SPECS)
    ]


def other_base(directory: Path, hidden_size: int = 128) -> Path:
    """A random Llama of another hidden size (4 layers, as the default model): the
    base of an adapter that does not fit the default model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory
