"""The Triton replica's client path alone: the CPU it spends per request.

``make bench-capacity`` measures the whole stack, and on a 2-core machine its ratios
move with everything else the machine runs. This isolates the part of the Triton
replica's work that talks to Triton: tokenizing a prompt with the repository's
preprocessing code, sending the engine step its tensors over gRPC, reading the
streamed responses and detokenizing them (``SidecarHost.generate`` over the replica's
own steps, as ``triton.pipeline: replica`` runs it), with no HTTP and no Serve.

It starts a Triton over the null-engine repository (5 ms steps, as ``make
bench-capacity``), then runs ``--requests`` generations of 64 tokens,
``--concurrency`` at a time, in one event loop, and prints the process CPU per request,
the wall time, the text chunks per answer and the answers that were not 64 tokens
(errors). To compare two checkouts, run it from each in turn, alternated::

    python -m bench.replica_client --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from bench.common import ROOT, build_bench_repository, make_prompts
from bench.loadgen import RequestRecord, run_level
from serve.engines.triton.sidecar import SidecarHost
from serve.engines.triton.steps import ReplicaSteps
from serve.generation import GenerateParams, GenerationError
from tritonllm import contract

OUTPUT_LEN = 64


class ReplicaClientTarget:
    """``SidecarHost.generate`` over the replica's own steps, as a load generator's
    target (``bench.loadgen``)."""

    name = "replica client"

    def __init__(self, host: SidecarHost, route: ReplicaSteps):
        self._host, self._route = host, route

    async def request(self, prompt: str, output_len: int) -> RequestRecord:
        record = RequestRecord(sent=time.perf_counter())
        params = GenerateParams(prompt, output_len, min_tokens=output_len)
        try:
            async for chunk in self._host.generate(params, self._route):
                if chunk.text:
                    record.arrivals.append(time.perf_counter())
                record.tokens = chunk.num_output_tokens
        except GenerationError as error:
            record.error = str(error)
        record.end = time.perf_counter()
        return record

    async def aclose(self) -> None:
        await self._host.close()


async def one_round(target: ReplicaClientTarget, prompts: list[str], concurrency: int) -> dict:
    try:
        await run_level(target, prompts[:16], 16, OUTPUT_LEN)  # warm-up
        cpu = time.process_time()
        records, wall = await run_level(target, prompts, concurrency, OUTPUT_LEN)
        cpu = time.process_time() - cpu
    finally:
        await target.aclose()
    ok = [r for r in records if r.ok and r.tokens == OUTPUT_LEN]
    return {
        "cpu_ms_per_request": round(1000 * cpu / len(records), 3),
        "wall_s": round(wall, 2),
        "chunks_per_request": round(sum(len(r.arrivals) for r in ok) / max(len(ok), 1), 2),
        "errors": len(records) - len(ok),
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
        target = ReplicaClientTarget(host, ReplicaSteps.load(repository, contract.ENSEMBLE))
        prompts = make_prompts(args.requests, 24)
        for _ in range(args.rounds):
            figures = asyncio.run(one_round(target, prompts, args.concurrency))
            print(json.dumps(figures), flush=True)
    finally:
        host.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
