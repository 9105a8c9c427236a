"""Fine-tuned variants of the default model for the multiplexing tests: the same
tokenizer, seeded changes to the weights, so each variant writes its own text."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tests.conftest import ROOT

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_variants(checkpoint: Path, destination: Path, names: list[str]) -> dict[str, Path]:
    """One checkpoint per name: the base with seeded noise on every weight."""
    from transformers import AutoModelForCausalLM

    variants = {}
    for seed, name in enumerate(names, start=1):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                noise = torch.randn(parameter.shape, generator=generator) * 0.3
                parameter.add_(noise * parameter.std())
        path = destination / name
        model.save_pretrained(path)
        for file in TOKENIZER_FILES:
            if (checkpoint / file).is_file():
                shutil.copy2(checkpoint / file, path / file)
        variants[name] = path
    return variants


def build_pool(variants: dict[str, Path], repository: Path, *build_args: str) -> Path:
    command = [sys.executable, "-m", "build_engines", "--repository", str(repository)]
    command += [f"--variant={name}={path}" for name, path in variants.items()]
    subprocess.run([*command, *build_args], check=True, cwd=ROOT)
    return repository
