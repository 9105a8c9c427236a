"""Install torch into this Python: the CPU build where there is no NVIDIA GPU.

    python scripts/install_torch.py 'torch==2.13.0' https://download.pytorch.org/whl/cpu

The same pin on PyPI is the CUDA build, several GB of NVIDIA libraries a CPU machine
never uses. So without ``nvidia-smi`` on PATH the pin comes from PyTorch's CPU wheel
index, when that index answers within a few seconds. A GPU machine, an empty index
argument, or an index that does not answer (a machine that reaches only a package
mirror) gets the plain pin from pip's configured index, at once: pip itself would
retry an unreachable index for minutes.

Standard library only: it runs in a fresh virtualenv, before the project is installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import urllib.request

PROBE_TIMEOUT_S = 3.0


def index_answers(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when ``url`` answers an HTTP GET within ``timeout_s``.

    The request runs in a daemon thread because urllib's timeout does not bound the
    name lookup, which can hang on a machine without DNS.
    """
    answered = threading.Event()

    def probe() -> None:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s):
                answered.set()
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return answered.is_set()


def choose_index(cpu_index: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[str | None, str]:
    """The index to install torch from (None: pip's own) and why, for the log."""
    if shutil.which("nvidia-smi"):
        return None, "nvidia-smi found: torch's default (CUDA) build"
    if not cpu_index:
        return None, "no CPU wheel index given: pip's configured index"
    if index_answers(cpu_index.rstrip("/") + "/torch/", timeout_s):
        return cpu_index, f"no NVIDIA GPU: the CPU build from {cpu_index}"
    return None, f"{cpu_index} did not answer in {timeout_s:g} s: pip's configured index"


def pip_command(spec: str, index: str | None) -> list[str]:
    command = [sys.executable, "-m", "pip", "install", "--quiet", spec]
    return command + ["--index-url", index] if index else command


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    spec, cpu_index = argv[0], argv[1] if len(argv) == 2 else ""
    index, reason = choose_index(cpu_index)
    print(f"{spec}: {reason}", flush=True)
    return subprocess.call(pip_command(spec, index))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
