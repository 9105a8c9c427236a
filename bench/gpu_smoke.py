"""``scripts/gpu_smoke.sh``: the GPU path end to end on one NVIDIA GPU, in minutes.

1. the torch engine on CUDA through Triton (sidecar): the default model's greedy
   answer through the ensemble equals transformers' ``generate()`` on the GPU;
2. the same request through the in-process host, where ``tritonserver`` imports:
   the same text;
3. where TensorRT-LLM is installed: ``make engines``'s trtllm target builds a tiny
   engine of the same checkpoint, a second build is skipped, and one request answers
   through the tensorrtllm backend (text compared with greedy, for information:
   fp16 kernels may pick another token on a near tie);
4. (``--pytest``) the in-process host's integration tests.

Prints one table; exits non-zero when a required step fails. Scratch repositories go
to ``build/gpu-smoke`` (git-ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
PROMPT, MAX_TOKENS = "The cat", 24  # the default model writes a sentence after it
# Small enough for any GPU and a build of a minute or two.
TINY_TRTLLM = """\
dtype: float16
max_batch_size: 4
max_input_len: 256
max_seq_len: 512
max_num_tokens: 1024
kv_cache_free_gpu_mem_fraction: 0.2
"""
console = Console(soft_wrap=True, width=132)


@dataclass
class Step:
    name: str
    status: str  # ok | FAILED | skipped
    seconds: float
    detail: str


def run_step(name: str, action: Callable[[], str], required: bool = True) -> Step:
    start = time.monotonic()
    try:
        detail = action()
        status = "ok"
    except Skip as skip:
        status, detail = "skipped", str(skip)
    except Exception as exc:  # a smoke run reports every failure and goes on
        traceback.print_exc()
        status = "FAILED" if required else "failed (info)"
        detail = f"{type(exc).__name__}: {exc}"[:300]
    return Step(name, status, time.monotonic() - start, detail)


class Skip(Exception):
    pass


def build_repository(destination: Path, *args: str) -> Path:
    from build_engines.repository import ModelRepository

    ModelRepository(ROOT / "model_repository").copy_layout(destination)
    command = [sys.executable, "-m", "build_engines", "--repository", str(destination), *args]
    subprocess.run(command, check=True, cwd=ROOT)
    return destination


def hf_greedy_text(checkpoint: Path, prompt: str, max_tokens: int, device: str = "cuda") -> str:
    """transformers' greedy answer (float32, like the torch engine here)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    model = model.to(device, torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(prompt)], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def ask(host, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> tuple[str, float, int]:
    """One streamed generation: (text, seconds to the first chunk, output tokens)."""
    from serve.generation import GenerateParams

    async def scenario():
        start, first, chunks = time.monotonic(), None, []
        async for chunk in host.generate(GenerateParams(prompt, max_tokens)):
            first = first or time.monotonic() - start
            chunks.append(chunk)
        if hasattr(host, "close"):
            await host.close()
        return "".join(c.text for c in chunks), first, chunks[-1].num_output_tokens

    return asyncio.run(scenario())


class Smoke:
    def __init__(self, scratch: Path, device: str = "cuda"):
        self.scratch = scratch
        self.device = device
        self.torch_repo = scratch / "torch"
        self.sidecar_text: str | None = None

    @property
    def checkpoint(self) -> Path:
        return self.torch_repo / "tensorrt_llm" / "1" / "hf_model"

    def gpu(self) -> str:
        import torch

        if self.device == "cpu":
            raise Skip("--device cpu: a dry run of the steps without a GPU")
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"

    def torch_engine(self) -> str:
        from serve.engines.triton.sidecar import SidecarHost

        args = ["--target", "torch", "--device", self.device, "--dtype", "float32"]
        build_repository(self.torch_repo, *args)
        host = SidecarHost(self.torch_repo).start()
        try:
            text, ttft, tokens = ask(host)
        finally:
            host.stop()
        expected = hf_greedy_text(self.checkpoint, PROMPT, MAX_TOKENS, self.device)
        if tokens < 1 or text != expected:
            raise AssertionError(f"engine {text!r} != generate() {expected!r}")
        self.sidecar_text = text
        return f"{tokens} tokens = generate(); first chunk {ttft * 1000:.0f} ms"

    def in_process(self) -> str:
        from serve.engines.triton.select import in_process_unavailable_reason

        reason = in_process_unavailable_reason()
        if reason:
            raise Skip(reason)
        if self.sidecar_text is None:
            raise Skip("the torch engine step failed")
        from serve.engines.triton.in_process import InProcessHost

        host = InProcessHost(self.torch_repo).start()
        try:
            text, ttft, tokens = ask(host)
        finally:
            host.stop()
        if text != self.sidecar_text:
            raise AssertionError(f"in-process {text!r} != sidecar {self.sidecar_text!r}")
        return f"{tokens} tokens, same text as the sidecar; first chunk {ttft * 1000:.0f} ms"

    def trtllm(self) -> str:
        from build_engines.targets.trtllm_engine import TrtllmTarget

        reason = TrtllmTarget().unavailable_reason()
        if reason:
            raise Skip(reason)
        if not self.checkpoint.is_dir():
            raise Skip("no default checkpoint (the torch engine step failed)")
        config = self.scratch / "trtllm-tiny.yaml"
        config.write_text(TINY_TRTLLM)
        args = [
            "--target",
            "trtllm",
            "--model",
            str(self.checkpoint),
            "--trtllm-config",
            str(config),
        ]
        repo = build_repository(self.scratch / "trtllm", *args)
        again = subprocess.run(
            [sys.executable, "-m", "build_engines", "--repository", str(repo), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if "up to date" not in again.stderr + again.stdout:
            raise AssertionError(f"second build was not skipped: {again.stderr[-300:]}")
        return self._ask_trtllm(repo)

    def _ask_trtllm(self, repo: Path) -> str:
        from serve.engines.triton.sidecar import SidecarHost

        host = SidecarHost(repo).start()
        try:
            text, ttft, tokens = ask(host)
        finally:
            host.stop()
        if not text or tokens < 1:
            raise AssertionError(f"empty answer from the engine ({tokens} tokens)")
        same = (
            "equals"
            if text == hf_greedy_text(self.checkpoint, PROMPT, MAX_TOKENS)
            else "differs from"
        )
        first = f"first chunk {ttft * 1000:.0f} ms"
        return f"{tokens} tokens ({same} fp32 generate()); rebuild skipped; {first}"


def pytest_in_process() -> str:
    from serve.engines.triton.select import in_process_unavailable_reason

    if in_process_unavailable_reason():
        raise Skip(in_process_unavailable_reason())
    module = "tests/integration/test_triton_hosts.py"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", module], cwd=ROOT)
    if result.returncode != 0:
        raise AssertionError(f"pytest {module} exited {result.returncode}")
    return module


def report(steps: list[Step]) -> Table:
    table = Table(title="GPU smoke")
    for column in ("step", "result", "s", "detail"):
        table.add_column(column, justify="right" if column == "s" else "left")
    for step in steps:
        table.add_row(step.name, step.status, f"{step.seconds:.0f}", step.detail)
    return table


def failed(steps: list[Step]) -> bool:
    return any(step.status == "FAILED" for step in steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_smoke", description=__doc__)
    p.add_argument("--scratch", type=Path, default=ROOT / "build" / "gpu-smoke")
    p.add_argument("--pytest", action="store_true", help="also run the in-process tests")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the steps, no GPU")
    args = p.parse_args(argv)
    smoke = Smoke(args.scratch, args.device)
    steps = [run_step("GPU", smoke.gpu)]
    if not failed(steps):  # without a GPU nothing below means anything
        steps.append(run_step(f"torch engine ({args.device}) via Triton", smoke.torch_engine))
        steps.append(run_step("in-process host", smoke.in_process))
        steps.append(run_step("TensorRT-LLM tiny engine", smoke.trtllm))
        if args.pytest:
            steps.append(run_step("pytest in-process host", pytest_in_process))
    console.print(report(steps))
    return 1 if failed(steps) else 0


if __name__ == "__main__":
    raise SystemExit(main())
