"""What the benchmarks share: the seeded prompt set, percentiles, the bench-model repository.

``make bench-engine`` (bench/engine.py) and ``make bench`` (bench/serving.py) send the
same prompts to the same ~30M-parameter model, built into a scratch repository under
``build/`` so the working tree's own ``model_repository`` is never touched.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stop_on_sigterm() -> None:
    """A SIGTERM (``docker stop``, systemd, a kill of the process group) ends the
    benchmark as Ctrl-C does: it raises KeyboardInterrupt, so the stacks and servers it
    started (each in a session of its own, out of reach of that group's signals) are
    stopped on the way out. Once: make passes its own SIGTERM on as well, and a second
    interrupt would cut that stop short."""

    def interrupt(*_) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)


WORDS = (
    "the a robot cat river town teacher letter server request builds sends answers near "
    "old many long small writes reads every morning while and then because sea window"
).split()


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1); NaN for no values."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def make_prompts(count: int, words: int, seed: int = 0) -> list[str]:
    """``count`` prompts of ``words`` words (about 1.3 tokens each), the same for a seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def build_bench_repository(
    scratch: Path, max_batch_size: int, num_threads: int = 0, *extra_args: str
) -> Path:
    """The tracked repository layout plus the bench model, under ``scratch`` (a no-op
    rebuild when current: build_engines skips an up-to-date build)."""
    from build_engines.repository import ModelRepository

    repository = scratch / "model_repository"
    # Refreshed every run, so the scratch copy serves this checkout's model code.
    ModelRepository(ROOT / "model_repository").copy_layout(repository)
    command = [sys.executable, "-m", "build_engines", "--only", "llm", "--size", "bench"]
    command += ["--repository", str(repository), "--max-batch-size", str(max_batch_size)]
    command += ["--num-threads", str(num_threads), *extra_args]
    subprocess.run(command, check=True, cwd=ROOT)
    return repository


def checkpoint_dir(repository: Path) -> Path:
    """The Hugging Face checkpoint a built torch-target repository serves."""
    return repository / "tensorrt_llm" / "1" / "hf_model"


def set_engine_parameter(repository: Path, key: str, value) -> None:
    """Rewrite one parameter of the built engine's config.pbtxt (a benchmark's or a
    test's variant of a built repository); KeyError where it has none."""
    config = repository / "tensorrt_llm" / "config.pbtxt"
    text, found = re.subn(
        rf'(key: "{key}" value: \{{ string_value: ")[^"]*"',
        lambda match: f'{match.group(1)}{value}"',
        config.read_text(),
    )
    if not found:
        raise KeyError(f"{config} has no parameter {key}")
    config.write_text(text)
