"""Extra model repositories for the tests: the built checkpoint under other limits."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def repository_with_limits(checkpoint_dir: Path, destination: Path, *build_args: str) -> Path:
    """Copy the tracked repository layout to ``destination`` and fill it for
    ``checkpoint_dir`` with ``build_args`` (e.g. ``--max-batch-size 1``)."""
    shutil.copytree(
        ROOT / "model_repository",
        destination,
        ignore=shutil.ignore_patterns("config.pbtxt", "hf_model", ".build.json"),
    )
    command = [sys.executable, "-m", "build_engines", "--repository", str(destination)]
    subprocess.run([*command, "--model", str(checkpoint_dir), *build_args], check=True, cwd=ROOT)
    return destination
