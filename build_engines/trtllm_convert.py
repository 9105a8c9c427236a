"""Hugging Face checkpoint -> TensorRT-LLM checkpoint, one rank file per GPU.

``python -m build_engines.trtllm_convert --model_dir HF --output_dir CKPT --dtype auto``

What TensorRT-LLM's per-model ``examples/models/core/<model>/convert_checkpoint.py``
scripts do for a plain (unquantized) checkpoint, on the installed package's public
API, so the NGC image needs no TensorRT-LLM source checkout:
``AutoModelForCausalLM.from_hugging_face(dir, dtype, mapping=Mapping(...))`` picks
the TensorRT-LLM class from the checkpoint's ``architectures``, and
``save_checkpoint(out, save_config=rank == 0)`` writes ``rank<N>.safetensors``
and one ``config.json`` (read at TensorRT-LLM 1.x: ``tensorrt_llm/models/automodel.py``,
``tensorrt_llm/mapping.py``, ``PretrainedModel.save_checkpoint``).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m build_engines.trtllm_convert")
    p.add_argument("--model_dir", type=Path, required=True, help="local HF checkpoint")
    p.add_argument("--output_dir", type=Path, required=True, help="TensorRT-LLM checkpoint")
    p.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    p.add_argument("--tp_size", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp_size", type=int, default=1, help="pipeline parallel size")
    return p.parse_args(argv)


def convert(model_dir: Path, output_dir: Path, dtype: str, tp_size: int, pp_size: int) -> None:
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models.automodel import AutoModelForCausalLM

    output_dir.mkdir(parents=True, exist_ok=True)
    world_size = tp_size * pp_size
    for rank in range(world_size):
        mapping = Mapping(world_size=world_size, rank=rank, tp_size=tp_size, pp_size=pp_size)
        model = AutoModelForCausalLM.from_hugging_face(str(model_dir), dtype, mapping=mapping)
        model.save_checkpoint(str(output_dir), save_config=rank == 0)
        del model  # one rank's weights in memory at a time


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    convert(args.model_dir, args.output_dir, args.dtype, args.tp_size, args.pp_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
