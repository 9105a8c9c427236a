"""tritonllm.lora_dirs: the contract's LoRA tensors written back as PEFT adapters.

The round trip a path-loading engine (TensorRT-LLM's LLM API) depends on: a PEFT
adapter made on the default model -> packed into lora_weights/lora_config as the
Serve side sends them -> written as a PEFT directory -> loaded by PEFT itself gives the
same output as the adapter it started from.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests import lora_adapters
from tritonllm.contract import LORA_CACHE_MISS
from tritonllm.lora import (
    ADAPTER_CONFIG,
    HF_TO_TRTLLM_MODULES,
    AdapterError,
    llama_module_shapes,
    pack_peft,
    read_peft_dir,
)
from tritonllm.lora_dirs import AdapterDirectories, write_peft_dir


def make_adapter(hf_model, path, r: int, alpha: int, modules, seed: int):
    """A PEFT adapter on ``hf_model`` with non-zero B (PEFT initialises B to zeros)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(modules), init_lora_weights=False
    )
    model = get_peft_model(_copy(hf_model), config)
    model.save_pretrained(path)
    return model.eval()


def _copy(hf_model):
    import copy

    return copy.deepcopy(hf_model)


def model_shapes(checkpoint_dir):
    return llama_module_shapes(json.loads((checkpoint_dir / "config.json").read_text()))


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize(
    ("r", "alpha", "modules"),
    [(8, 16, tuple(HF_TO_TRTLLM_MODULES)), (4, 32, ("q_proj", "v_proj", "down_proj"))],
)
def test_a_peft_adapter_survives_pack_unpack_and_loads_in_peft_with_the_same_output(
    hf_model, checkpoint_dir, tmp_path, r, alpha, modules
):
    from peft import PeftModel

    original = make_adapter(hf_model, tmp_path / "original", r, alpha, modules, seed=r)
    packed = read_peft_dir(lambda name: (tmp_path / "original" / name).read_bytes())
    shapes, layers = model_shapes(checkpoint_dir)
    write_peft_dir(packed, shapes, layers, tmp_path / "written", str(checkpoint_dir))

    config = json.loads((tmp_path / "written" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (r, r)  # B arrives scaled already
    assert sorted(config["target_modules"]) == sorted(modules)
    reloaded = PeftModel.from_pretrained(_copy(hf_model), tmp_path / "written").eval()
    ids = [1, 17, 300, 42, 1999, 5, 77, 1024]
    base, want, got = logits(hf_model, ids), logits(original, ids), logits(reloaded, ids)
    delta = (want - base).abs().max().item()
    assert delta > 1e-2, "the adapter must change the output for the test to mean anything"
    # float16 on the wire: the same delta up to its rounding.
    assert torch.allclose(got, want, atol=2e-3 * max(1.0, delta), rtol=0)
    assert (got - want).abs().max().item() < 0.01 * delta


def test_modules_of_smaller_rank_are_padded_to_the_largest_without_changing_the_product(
    checkpoint_dir, tmp_path
):
    from safetensors.numpy import load_file

    shapes, layers = model_shapes(checkpoint_dir)
    rng = np.random.default_rng(0)
    hidden, q_out = shapes["q_proj"]
    state = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": rng.normal(
            size=(2, hidden)
        ),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": rng.normal(
            size=(q_out, 2)
        ),
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": rng.normal(
            size=(6, hidden)
        ),
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight": rng.normal(
            size=(q_out, 6)
        ),
    }
    # Per-module ranks are one adapter's in TensorRT-LLM's layout (PEFT's rank_pattern).
    packed = pack_peft({"r": 6, "lora_alpha": 6}, state)
    write_peft_dir(packed, shapes, layers, tmp_path / "a")
    written = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    for layer, rank in ((0, 2), (1, 6)):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        a, b = written[f"{prefix}.lora_A.weight"], written[f"{prefix}.lora_B.weight"]
        assert a.shape == (6, hidden) and b.shape == (q_out, 6)
        a0, b0 = state[f"{prefix}.lora_A.weight"], state[f"{prefix}.lora_B.weight"]
        scale = 6 / rank  # PEFT's alpha / r for that module's own rank
        want = (b0 * scale) @ a0
        got = b.astype(np.float32) @ a.astype(np.float32)
        assert np.allclose(got, want, atol=0.05 * np.abs(want).max())


def test_adapter_directories_write_once_answer_a_miss_and_evict_the_least_recent(
    hf_model, checkpoint_dir, tmp_path
):
    make_adapter(hf_model, tmp_path / "peft", 4, 8, ("q_proj",), seed=1)
    packed = read_peft_dir(lambda name: (tmp_path / "peft" / name).read_bytes())
    shapes, layers = model_shapes(checkpoint_dir)
    dirs = AdapterDirectories(tmp_path / "cache", shapes, layers, max_rank=8, capacity=2)

    with pytest.raises(AdapterError) as miss:
        dirs.path(7, None)
    assert LORA_CACHE_MISS.match(str(miss.value))[1] == "7"
    path = dirs.path(7, packed)
    assert (path / "adapter_model.safetensors").is_file() and 7 in dirs
    mtime = (path / "adapter_model.safetensors").stat().st_mtime_ns
    assert dirs.path(7, None) == path and dirs.path(7, packed) == path  # not rewritten
    assert (path / "adapter_model.safetensors").stat().st_mtime_ns == mtime
    dirs.path(8, packed)
    dirs.path(7, None)  # 7 is now the most recent
    dirs.path(9, packed)  # past the capacity: 8 goes
    assert 8 not in dirs and 7 in dirs and 9 in dirs and len(dirs) == 2
    assert not (tmp_path / "cache" / "task-8").exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["task-7", "task-9"]
    with pytest.raises(AdapterError, match="cache"):
        dirs.path(8, None)


def test_an_adapter_that_does_not_fit_writes_nothing(hf_model, checkpoint_dir, tmp_path):
    make_adapter(hf_model, tmp_path / "peft", 16, 16, ("v_proj",), seed=2)
    packed = read_peft_dir(lambda name: (tmp_path / "peft" / name).read_bytes())
    shapes, layers = model_shapes(checkpoint_dir)
    dirs = AdapterDirectories(tmp_path / "cache", shapes, layers, max_rank=8, capacity=4)
    with pytest.raises(AdapterError, match="rank 16.*up to 8"):
        dirs.path(1, packed)
    smaller = AdapterDirectories(tmp_path / "cache", shapes, 2, max_rank=64, capacity=4)
    with pytest.raises(AdapterError, match="the model has 2 layers"):
        smaller.path(1, packed)
    assert len(dirs) == 0 and len(smaller) == 0
    assert not any((tmp_path / "cache").iterdir())


def test_an_adapter_of_another_base_is_refused(checkpoint_dir, tmp_path):
    # Rows are zero-padded to the widest, so an adapter of a larger base unpacks into
    # this model's shapes; the check the replica and the torch engine make refuses it.
    base = lora_adapters.other_base(tmp_path / "base", hidden_size=512)
    spec = lora_adapters.SPECS[1]
    stranger = lora_adapters.make_adapter(base, spec, 0, tmp_path / "adapter", task_id=77)
    shapes, layers = model_shapes(checkpoint_dir)
    dirs = AdapterDirectories(tmp_path / "cache", shapes, layers, max_rank=64, capacity=4)
    with pytest.raises(AdapterError, match="another base"):
        dirs.path(77, stranger.tensors)
    assert 77 not in dirs
