"""The Triton replica's client path alone: the CPU it spends per request.

``make bench-capacity`` measures the whole stack, and on a 2-core machine its ratios
move with everything else the machine runs. This isolates the part of the Triton
replica's work that talks to Triton: tokenizing a prompt with the repository's
preprocessing code, sending the engine step its tensors over gRPC, reading the
streamed responses and detokenizing them (``SidecarHost.generate`` over the replica's
own steps, as ``triton.pipeline: replica`` runs it), with no HTTP and no Serve.

It starts a Triton over the null-engine repository (5 ms steps, as ``make
bench-capacity``), then runs ``--requests`` generations of 64 tokens,
``--concurrency`` at a time, in one event loop, and prints the process CPU per request
and the wall time. To compare two checkouts, run it from each in turn, alternated::

    python -m bench.replica_client --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from bench.common import ROOT, build_bench_repository, make_prompts
from serve.generation import GenerateParams
from serve.triton.sidecar import SidecarHost
from serve.triton.steps import ReplicaSteps
from tritonllm import contract

OUTPUT_LEN = 64


async def one_round(host: SidecarHost, route: ReplicaSteps, prompts: list[str], concurrency: int):
    todo = list(prompts)
    chunks: list[int] = []

    async def answer(prompt: str) -> int:
        params = GenerateParams(prompt, OUTPUT_LEN, min_tokens=OUTPUT_LEN)
        return sum([1 async for _ in host.generate(params, route)])

    async def client() -> None:
        while todo:
            chunks.append(await answer(todo.pop()))

    await asyncio.gather(*(answer(p) for p in prompts[:16]))  # warm-up
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "cpu_ms_per_request": round(1000 * cpu / len(prompts), 3),
        "wall_s": round(wall, 2),
        "chunks_per_request": round(sum(chunks) / len(chunks), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replica_client", description=__doc__)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    repository = build_bench_repository(
        ROOT / "build" / "bench-replica-client",
        256,
        0,
        *("--target", "null", "--null-step-ms", "5", "--max-queue-size", "512"),
    ).resolve()
    host = SidecarHost(repository).start()
    try:
        route = ReplicaSteps.load(repository, contract.ENSEMBLE)
        prompts = make_prompts(args.requests, 24)
        for _ in range(args.rounds):

            async def measured():
                try:
                    return await one_round(host, route, prompts, args.concurrency)
                finally:
                    await host.close()

            print(json.dumps(asyncio.run(measured())), flush=True)
    finally:
        host.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
