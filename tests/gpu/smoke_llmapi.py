"""``scripts/gpu_smoke.sh``'s TensorRT-LLM PyTorch-backend step, on one NVIDIA GPU.

Where the image's TensorRT-LLM has the LLM API on its PyTorch backend (1.0 and later):
``make engines TARGET=trtllm-pytorch`` fills a scratch repository for the default
model's checkpoint (no engine build), a second build changes nothing, and one streamed
request and one with a stop word answer through Triton (sidecar) and the ensemble.
The text is compared with transformers' greedy one for information (fp16 kernels may
pick another token on a near tie). Prints a table; exits non-zero when a required
step fails, 0 with "skipped" rows where TensorRT-LLM or a GPU is missing.

    python -m tests.gpu.smoke_llmapi [--scratch build/gpu-smoke]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.gpu_smoke import (
    MAX_TOKENS,
    PROMPT,
    ROOT,
    TINY_TRTLLM,
    Skip,
    Smoke,
    ask,
    build_repository,
    console,
    failed,
    hf_greedy_text,
    report,
    run_step,
)


class LLMAPISmoke:
    def __init__(self, scratch: Path):
        self.scratch = scratch
        self.repo = scratch / "trtllm-pytorch"
        self.torch = Smoke(scratch)  # its torch repository holds the default checkpoint

    def checkpoint(self) -> Path:
        if not self.torch.checkpoint.is_dir():
            build_repository(self.torch.torch_repo, "--target", "torch", "--only", "llm")
        return self.torch.checkpoint

    def args(self) -> list[str]:
        config = self.scratch / "trtllm-pytorch-tiny.yaml"
        config.write_text(TINY_TRTLLM)  # the same small settings as the engine build's
        target = ["--target", "trtllm-pytorch", "--only", "llm"]
        return [*target, "--model", str(self.checkpoint()), "--trtllm-config", str(config)]

    def build(self) -> str:
        from build_engines.targets.trtllm_pytorch import TrtllmPytorchTarget

        reason = TrtllmPytorchTarget().unavailable_reason()
        if reason:
            raise Skip(reason)
        args = self.args()
        build_repository(self.repo, *args)
        again = subprocess.run(
            [sys.executable, "-m", "build_engines", "--repository", str(self.repo), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if "up to date" not in again.stderr + again.stdout:
            raise AssertionError(f"second build changed something: {again.stderr[-300:]}")
        return f"configs for {self.checkpoint().name}; a second build is up to date"

    def answer(self) -> str:
        from serve.engines.triton.sidecar import SidecarHost
        from serve.generation import GenerateParams

        if not (self.repo / "tensorrt_llm" / "config.pbtxt").is_file():
            raise Skip("no trtllm-pytorch repository (the build step did not run)")
        host = SidecarHost(self.repo).start()
        try:
            text, ttft, tokens = ask(host)
            expected = hf_greedy_text(self.checkpoint(), PROMPT, MAX_TOKENS)
            words = expected.split()
            stop = f" {words[1]}" if len(words) > 2 else None
            stopped = ask_with_stop(host, GenerateParams(PROMPT, MAX_TOKENS, stop=(stop,)))
        finally:
            host.stop()
        if not text or tokens < 1:
            raise AssertionError(f"empty answer from the LLM API ({tokens} tokens)")
        same = "equals" if text == expected else "differs from"
        stop_note = f"stop word {stop!r}: {len(stopped)} chars" if stop else "no stop word tried"
        if stop and len(stopped) >= len(text):
            raise AssertionError(f"the stop word {stop!r} did not end {stopped!r}")
        return (
            f"{tokens} tokens ({same} fp32 generate()); {stop_note}; "
            f"first chunk {ttft * 1000:.0f} ms"
        )


def ask_with_stop(host, params) -> str:
    import asyncio

    async def scenario():
        chunks = [c async for c in host.generate(params)]
        if hasattr(host, "close"):
            await host.close()
        return "".join(c.text for c in chunks)

    return asyncio.run(scenario())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.gpu.smoke_llmapi", description=__doc__)
    p.add_argument("--scratch", type=Path, default=ROOT / "build" / "gpu-smoke")
    args = p.parse_args(argv)
    args.scratch.mkdir(parents=True, exist_ok=True)
    smoke = LLMAPISmoke(args.scratch)
    steps = [run_step("GPU", smoke.torch.gpu)]
    if not failed(steps):
        steps.append(run_step("TensorRT-LLM PyTorch backend: build", smoke.build))
        steps.append(run_step("TensorRT-LLM PyTorch backend: answer", smoke.answer))
    console.print(report(steps))
    return 1 if failed(steps) else 0


if __name__ == "__main__":
    raise SystemExit(main())
