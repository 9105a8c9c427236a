"""EleutherAI's lm-evaluation-harness, as users check a deployed model against its
checkpoint, in a virtualenv of its own: its ``datasets`` needs pyarrow, whose current
releases need NumPy 2, and Ray imports pyarrow wherever it is installed (the project's
environment keeps NumPy 1 for the Triton wheel). It has torch (the CPU build, as the
Makefile installs it) and transformers for lm-eval's own ``hf`` model. Made once per
machine; ``python -m tests.lm_eval_env`` makes it, and ``make test`` does beside the
vLLM and AIPerf environments.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = "lm-eval[api,hf]==0.4.13"
LM_EVAL_VENV = ROOT / "build" / "lm-eval-venv"
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
TORCH_INDEX = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")


def ensure() -> Path:
    """The ``lm_eval`` command, installed first where it is not."""
    binary = LM_EVAL_VENV / "bin" / "lm_eval"
    if not binary.exists():
        python = str(LM_EVAL_VENV / "bin" / "python")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(LM_EVAL_VENV)], check=True)
        torch = [python, str(ROOT / "scripts" / "install_torch.py"), TORCH_SPEC, TORCH_INDEX]
        subprocess.run(torch, check=True, timeout=900)
        pip = [python, "-m", "pip", "install", "--quiet", LM_EVAL]
        subprocess.run(pip, check=True, timeout=900)
    return binary


if __name__ == "__main__":
    print(ensure())
