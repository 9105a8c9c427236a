"""NVIDIA AIPerf, as users load-test an OpenAI endpoint, in a virtualenv of its own (it
pins versions of pandas, rich and prometheus-client of its own): the client of
``test_an_aiperf_run_completes_without_errors``. Made once per machine.

``python -m tests.aiperf_env`` makes it; ``make test`` does, beside the vLLM
environment, so its install (about two minutes) overlaps that one's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

AIPERF = "aiperf==0.13.0"
AIPERF_VENV = Path(__file__).resolve().parents[1] / "build" / "aiperf-venv"


def ensure() -> Path:
    """The ``aiperf`` command, installed first where it is not."""
    binary = AIPERF_VENV / "bin" / "aiperf"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(AIPERF_VENV)], check=True)
        pip = [str(AIPERF_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", AIPERF]
        subprocess.run(pip, check=True, timeout=900)
    return binary


if __name__ == "__main__":
    print(ensure())
