"""What chunked context costs one long prompt: its prefill on the bench model in one
forward and in chunks of several sizes, each chunk after the ones before it (as the
engine runs them), on this process's torch threads.

    python -m bench.prefill_chunks [--prompt-tokens 1200] [--chunks 512 256 128]

Times are the median of ``--repeats`` runs, after two warm-up runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from rich.console import Console

from bench.common import ROOT, build_bench_repository, checkpoint_dir
from tritonllm.engine.runner import CausalLMRunner

console = Console()


def prefill_seconds(runner: CausalLMRunner, prompt: list[int], chunk: int) -> float:
    cache = runner.new_cache(1, len(prompt))
    start = time.perf_counter()
    for done in range(0, len(prompt), chunk):
        end = min(done + chunk, len(prompt))
        runner.prefill(cache, [0], [prompt[:end]], [done])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_chunks", description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=1200)
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 256, 128])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    repository = build_bench_repository(ROOT / "build" / "bench-prefill-chunks", 1)
    runner = CausalLMRunner(checkpoint_dir(repository), device="cpu")
    rng = random.Random(0)
    prompt = [rng.randrange(100, runner.vocab_size) for _ in range(args.prompt_tokens)]
    console.print(f"{args.prompt_tokens}-token prompt, {torch.get_num_threads()} torch threads")
    whole = None
    for chunk in [args.prompt_tokens, *args.chunks]:
        for _ in range(2):
            prefill_seconds(runner, prompt, chunk)
        ms = 1000 * statistics.median(
            prefill_seconds(runner, prompt, chunk) for _ in range(args.repeats)
        )
        whole = whole or ms
        label = "whole" if chunk == args.prompt_tokens else f"chunks of {chunk}"
        console.print(f"{label:>16}: {ms:6.0f} ms  ({ms / whole:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
