"""The torch engine's LoRA cost: tokens/s of concurrent streams on the base model
against the same streams spread over adapters, in one process, one run.

Closed loop: each of ``--streams`` clients sends its next request when the last one
ends; every request asks for exactly ``--output-len`` tokens (no end id). Rounds
alternate base, adapters, base, ... so that a busy machine's drift hits both alike.
The first base round runs before any adapter (the model as loaded); later base rounds
run with the adapter layers installed, which a batch without adapters must not pay
for. Adapters are random, of ``--rank`` on all 7 projections, loaded before timing
(``python -m bench.engine_lora --help``).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import ROOT, build_bench_repository, checkpoint_dir, make_prompts
from tritonllm.lora import HF_TO_TRTLLM_MODULES, LoraTensors, pack_peft


def random_adapter(shapes: dict[str, tuple[int, int]], layers: int, rank: int, seed: int):
    """A rank-``rank`` adapter on every projection, packed as a request carries it."""
    rng = np.random.default_rng(seed)
    state = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in shapes.items():
            block = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            state[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.02, (rank, fan_in))
            state[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (fan_out, rank))
    return pack_peft({"r": rank, "lora_alpha": 2 * rank}, state)


@dataclass(frozen=True)
class Round:
    tokens_per_s: float
    # Per second of this process's CPU time: the cost, whatever else shares the machine.
    tokens_per_cpu_s: float


class Sink:
    def __init__(self):
        self.tokens = 0
        self.error = None
        self.done = threading.Event()

    def send(self, chunk):
        self.tokens += len(chunk.token_ids)
        if chunk.finished:
            self.done.set()

    def fail(self, message, code="INTERNAL"):
        self.error = message
        self.done.set()

    def is_cancelled(self):
        return False


def run_round(engine, prompts, adapters: list[tuple[int, LoraTensors]], args) -> Round:
    """Output tokens of ``args.streams`` closed-loop clients per second of wall time and
    of this process's CPU time; stream ``i`` uses adapter ``i % len(adapters)`` (none
    when ``adapters`` is empty)."""
    from tritonllm.engine.request import GenerationRequest

    total = [0] * args.streams

    def client(i: int) -> None:
        task_id = adapters[i % len(adapters)][0] if adapters else None
        for r in range(args.requests_per_stream):
            sink = Sink()
            request = GenerationRequest(
                request_id=f"{i}-{r}",
                input_ids=tuple(prompts[(i * args.requests_per_stream + r) % len(prompts)]),
                max_tokens=args.output_len,
                exclude_input_in_output=True,
                lora_task_id=task_id,
            )
            engine.submit(request, sink)
            sink.done.wait()
            if sink.error:
                raise RuntimeError(sink.error)
            total[i] += sink.tokens

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.streams)]
    start, cpu = time.perf_counter(), time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return Round(sum(total) / wall, sum(total) / cpu)


def load_adapters(engine, adapters, prompt) -> None:
    """Each adapter sent once with its weights (as a first request does), untimed."""
    from tritonllm.engine.request import GenerationRequest

    for task_id, tensors in adapters:
        sink = Sink()
        engine.submit(
            GenerationRequest(
                f"load-{task_id}", tuple(prompt), 1, lora_task_id=task_id, lora=tensors
            ),
            sink,
        )
        sink.done.wait()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", type=Path, help="a checkpoint (default: the bench model)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--lora", type=int, default=8, help="adapters the streams spread over")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2, help="base/adapter round pairs")
    p.add_argument("--num-threads", type=int, default=0, help="the engine's (0: its default)")
    p.add_argument("--scratch", type=Path, default=ROOT / "build" / "bench-lora")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from tritonllm.engine.runner import CausalLMRunner
    from tritonllm.engine.scheduler import Engine
    from tritonllm.tokenization import load_tokenizer

    args = parse_args(argv)
    checkpoint = args.checkpoint or checkpoint_dir(
        build_bench_repository(args.scratch, args.streams)
    )
    runner = CausalLMRunner(checkpoint, dtype="float32")
    engine = Engine(runner, max_batch_size=args.streams, num_threads=args.num_threads)
    tokenizer = load_tokenizer(str(checkpoint))
    prompts = [tokenizer.encode(p) for p in make_prompts(64, args.prompt_words)]
    shapes, layers = runner.lora.module_shapes()
    assert set(shapes) == set(HF_TO_TRTLLM_MODULES)
    adapters = [(100 + i, random_adapter(shapes, layers, args.rank, i)) for i in range(args.lora)]
    base, lora, installed = [], [], []
    try:
        run_round(engine, prompts, [], args)  # warm-up: first calls, allocations
        base.append(run_round(engine, prompts, [], args))  # the model as loaded
        load_adapters(engine, adapters, prompts[0])
        for _ in range(args.rounds):
            lora.append(run_round(engine, prompts, adapters, args))
            installed.append(run_round(engine, prompts, [], args))
    finally:
        engine.shutdown()
    print(
        f"{checkpoint}: {args.streams} streams x {args.requests_per_stream} requests x "
        f"{args.output_len} tokens, {args.lora} adapters of rank {args.rank} (all 7 projections)"
    )
    print("                          tok/s (wall)        tok per CPU-s")
    print(f"base, as loaded:          {_fmt(base)}")
    print(f"base, adapter layers in:  {_fmt(installed)}")
    print(f"{args.lora} adapters:               {_fmt(lora)}")
    for name in ("tokens_per_s", "tokens_per_cpu_s"):
        ratio = _median(lora, name) / _median(base + installed, name)
        print(f"adapters / base, {name}: {ratio:.2f}x (medians)")
    return 0


def _median(rounds: list[Round], name: str) -> float:
    return statistics.median(getattr(r, name) for r in rounds)


def _fmt(rounds: list[Round]) -> str:
    wall = ", ".join(f"{r.tokens_per_s:.0f}" for r in rounds)
    cpu = ", ".join(f"{r.tokens_per_cpu_s:.0f}" for r in rounds)
    return f"{wall:<20} {cpu}"


if __name__ == "__main__":
    raise SystemExit(main())
