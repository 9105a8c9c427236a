"""Paths of a model repository, and which of its files a build generates.

Two repositories, each served by its own Triton: the LLM's (``model_repository/``:
ensemble, preprocessing, tensorrt_llm, postprocessing) and the embeddings'
(``embedding_repository/``: embeddings). In each, one model's version folder holds the
weights a build writes (``<weights_model>/1/hf_model``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from tritonllm import contract

MANIFEST = ".build.json"
# The tracked Python-backend adapters in a weights model's version folder: model.py
# (the torch engine, the embeddings) and llmapi.py (TensorRT-LLM's PyTorch backend).
ADAPTERS = ("model.py", "llmapi.py")


class ModelRepository:
    """The LLM's repository."""

    models = contract.MODELS
    weights_model = contract.TENSORRT_LLM
    kind = "model repository"
    option = "--repository model_repository"  # how the CLI names it, for error messages

    def __init__(self, root: Path | str):
        self.root = Path(root).resolve()

    def model_dir(self, model: str) -> Path:
        return self.root / model

    def config_path(self, model: str) -> Path:
        return self.model_dir(model) / "config.pbtxt"

    def template_path(self, model: str, target: str) -> Path:
        """``config.pbtxt.<target>.in`` where a target needs its own, else ``config.pbtxt.in``."""
        specific = self.model_dir(model) / f"config.pbtxt.{target}.in"
        return specific if specific.exists() else self.model_dir(model) / "config.pbtxt.in"

    @property
    def engine_version_dir(self) -> Path:
        return self.model_dir(self.weights_model) / "1"

    @property
    def default_checkpoint_dir(self) -> Path:
        return self.engine_version_dir / "hf_model"

    def reference(self, path: Path) -> str:
        """How a config names ``path``: relative to the repository when inside it."""
        path = path.resolve()
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)

    def check_layout(self) -> None:
        missing = [m for m in self.models if not self.model_dir(m).is_dir()]
        if missing:
            raise FileNotFoundError(
                f"{self.root} is not this project's {self.kind} "
                f"(missing {', '.join(missing)}); run from the project root or pass {self.option}"
            )

    def read_manifest(self) -> dict | None:
        try:
            return json.loads((self.root / MANIFEST).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def holds(self, model_fingerprint: dict, checkpoint: Path) -> bool:
        """Whether the last build wrote this model's checkpoint (a rebuild can skip it)."""
        manifest = self.read_manifest() or {}
        return manifest.get("model") == model_fingerprint and (checkpoint / "config.json").is_file()

    def write_manifest(self, manifest: dict) -> None:
        write_if_changed(
            self.root / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        )

    def generated_paths(self) -> list[Path]:
        """Everything a build writes (all git-ignored); the tracked files stay."""
        paths = [self.root / MANIFEST]
        paths += [self.config_path(m) for m in self.models]
        paths += [p for p in self.engine_version_dir.iterdir() if p.name not in ADAPTERS]
        return [p for p in paths if p.exists()]

    def copy_layout(self, destination: Path):
        """The tracked files (templates, model.py adapters) under ``destination``, none of
        what a build writes; refreshes an existing copy in place."""
        generated = {p.resolve() for p in self.generated_paths()}
        shutil.copytree(
            self.root,
            destination,
            ignore=lambda folder, names: [
                n for n in names if (Path(folder) / n).resolve() in generated
            ],
            dirs_exist_ok=True,
        )
        return type(self)(destination)

    def clean(self) -> list[Path]:
        removed = self.generated_paths()
        for path in removed:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        return removed

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())


class EmbeddingRepository(ModelRepository):
    """The embeddings model's repository (its own Triton, CPU or GPU independently)."""

    models = contract.EMBEDDING_MODELS
    weights_model = contract.EMBEDDINGS
    kind = "embeddings repository"
    option = "--embedding-repository embedding_repository"


def link_or_copy(source: Path, destination: Path, files: Iterable[Path]) -> None:
    """``files`` (under ``source``) at the same places under a fresh ``destination``:
    hard links where the two share a file system (no extra disk), copies elsewhere."""
    shutil.rmtree(destination, ignore_errors=True)
    for path in files:
        target = destination / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:  # another file system: copy instead
            shutil.copy2(path, target)


def write_if_changed(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` unless the file holds it already, through a temporary
    file renamed over it: an up-to-date build leaves the repository as it was, and a
    Triton reading a config while another build refills it (two test runs side by side)
    never reads half a file."""
    try:
        if path.read_text() == text:
            return
    except FileNotFoundError:
        pass
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
