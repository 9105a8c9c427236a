"""Shared fixtures: one built default repository and one Triton server per session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"


@pytest.fixture(scope="session")
def built_repository() -> Path:
    """The default model repository, built if needed (a no-op when current)."""
    subprocess.run(
        [sys.executable, "-m", "build_engines", "--repository", str(REPOSITORY)],
        check=True,
        cwd=ROOT,
    )
    return REPOSITORY


@pytest.fixture(scope="session")
def checkpoint_dir(built_repository) -> Path:
    return built_repository / "tensorrt_llm" / "1" / "hf_model"


@pytest.fixture(scope="session")
def tokenizer(checkpoint_dir):
    from tritonllm.tokenization import load_tokenizer

    return load_tokenizer(str(checkpoint_dir))


@pytest.fixture(scope="session")
def hf_model(checkpoint_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint_dir, local_files_only=True).eval()


@pytest.fixture(scope="session")
def triton(built_repository):
    from serve.triton.launcher import TritonProcess

    with TritonProcess(built_repository).start(timeout_s=180) as server:
        yield server
