"""Extra model repositories for the tests: the built checkpoint under other limits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from build_engines.repository import ModelRepository
from tests.conftest import ROOT


def repository_with_limits(checkpoint_dir: Path, destination: Path, *build_args: str) -> Path:
    """Copy the tracked repository layout to ``destination`` and fill it for
    ``checkpoint_dir`` with ``build_args`` (e.g. ``--max-batch-size 1``)."""
    ModelRepository(ROOT / "model_repository").copy_layout(destination)
    command = [sys.executable, "-m", "build_engines", "--only", "llm"]
    command += ["--repository", str(destination)]
    subprocess.run([*command, "--model", str(checkpoint_dir), *build_args], check=True, cwd=ROOT)
    return destination
