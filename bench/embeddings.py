"""``make bench-embeddings``: what Triton's dynamic batching buys the embeddings model.

One run, one machine, the same seeded sentences sent in the same order to two
embeddings repositories built side by side from all-MiniLM-L6-v2:

- ``batching on``: a ``dynamic_batching`` block (the build's defaults unless given),
  so requests that queue while the model runs share its next forward;
- ``batching off``: no ``dynamic_batching``, so every request is its own execute.

Each is served by its own Triton (both up; at each concurrency they take turns, for
several rounds), over gRPC (tritonclient), by closed-loop clients (each sends its
next request when the last one is answered), one sentence per request. Figures,
pooled over the rounds: requests/s over the time spent at the level, p50/p99
latency, and the mean batch Triton formed (its statistics API: inferences /
executions). Writes JSON next to the scratch repositories.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.common import percentile, stop_on_sigterm

ROOT = Path(__file__).resolve().parent.parent
console = Console(soft_wrap=True, width=132)

WORDS = (
    "the a robot cat river town teacher letter server request builds sends answers near "
    "old many long small writes reads every morning while and then because sea window "
    "bright quiet market storm garden train station music paints before after under"
).split()


@dataclass
class Level:
    """One repository at one concurrency, pooled over the rounds."""

    name: str
    concurrency: int
    requests: int = 0
    seconds: float = 0.0
    inferences: int = 0  # texts Triton ran (its statistics)
    executions: int = 0  # model executes Triton made for them
    errors: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)
    round_rates: list[float] = field(default_factory=list)  # requests/s of each round

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def p50_ms(self) -> float:
        return 1000 * percentile(self.latencies, 0.5)

    @property
    def p99_ms(self) -> float:
        return 1000 * percentile(self.latencies, 0.99)

    @property
    def mean_batch(self) -> float:
        """Texts per execute."""
        return self.inferences / self.executions if self.executions else float("nan")

    def add(self, other: Level) -> None:
        self.requests += other.requests
        self.seconds += other.seconds
        self.inferences += other.inferences
        self.executions += other.executions
        self.errors += other.errors
        self.latencies += other.latencies
        self.round_rates.append(other.requests_per_s)

    def summary(self) -> dict:
        fields = ("name", "concurrency", "requests", "seconds", "errors", "round_rates")
        figures = ("requests_per_s", "p50_ms", "p99_ms", "mean_batch")
        return {k: getattr(self, k) for k in (*fields, *figures)}


def make_sentences(count: int, seed: int = 0, words: tuple[int, int] = (6, 30)) -> list[str]:
    """Seeded sentences of 6 to 30 words (about 8 to 35 tokens each)."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))).capitalize() + "."
        for _ in range(count)
    ]


def counts(before: dict, after: dict) -> tuple[int, int]:
    """Inferences (texts) and executions between two statistics snapshots of one model."""
    inferences = int(after["inference_count"]) - int(before.get("inference_count", 0))
    executions = int(after["execution_count"]) - int(before.get("execution_count", 0))
    return inferences, executions


# -- the repositories ---------------------------------------------------------------


def build_repositories(scratch: Path, on, off) -> dict[str, Path]:
    """Two embeddings repositories from the tracked layout: batching ``on`` and ``off``
    (:class:`~build_engines.embeddings.EmbeddingsOptions` each)."""
    from build_engines.embeddings import EmbeddingsSpec, build_embeddings
    from build_engines.repository import EmbeddingRepository

    class Quiet:
        def stage(self, text: str) -> None:
            console.log(text)

        def steps(self, total: int):
            return lambda *_: None

    repositories = {}
    for name, options in (("batching on", on), ("batching off", off)):
        path = scratch / name.replace(" ", "-")
        # Refreshed every run, so the scratch copy serves this checkout's model code.
        repo = EmbeddingRepository(ROOT / "embedding_repository").copy_layout(path)
        build_embeddings(EmbeddingsSpec(options=options), repo, Quiet())
        repositories[name] = path
    return repositories


# -- the load -----------------------------------------------------------------------


async def triton_statistics(client) -> dict:
    from tritonllm import contract

    stats = await client.get_inference_statistics(contract.EMBEDDINGS, as_json=True)
    return stats["model_stats"][0]


async def settled_statistics(client, tries: int = 50, pause_s: float = 0.02) -> dict:
    """The statistics once the last execute is counted: Triton counts a request's
    inference when its response is sent, inside the Python model's ``execute``, and the
    execute itself only when it returns, so a snapshot taken as the last response
    arrives can hold one inference more than its executes account for."""
    stats = await triton_statistics(client)
    for _ in range(tries):
        await asyncio.sleep(pause_s)
        again = await triton_statistics(client)
        if again == stats:
            return stats
        stats = again
    return stats


async def embed(client, sentence: str) -> None:
    from serve.engines.triton.client import infer_inputs
    from tritonllm import contract

    text = np.array([[sentence.encode()]], dtype=object)
    result = await client.infer(contract.EMBEDDINGS, infer_inputs({"text": text}))
    if result.as_numpy(contract.EMBEDDINGS_VECTOR.name).shape[0] != 1:
        raise RuntimeError("one embedding per sentence expected")


async def drive(url: str, name: str, sentences: list[str], concurrency: int) -> Level:
    """``concurrency`` closed-loop clients as coroutines on one gRPC channel: one thread,
    so no client waits on the GIL behind 31 others (threads did, on 2 cores)."""
    import tritonclient.grpc.aio as grpc_aio

    todo = list(reversed(sentences))  # popped from the end: sent in the given order
    latencies, errors = [], 0
    client = grpc_aio.InferenceServerClient(url)

    async def client_loop() -> None:
        nonlocal errors
        while todo:
            sentence = todo.pop()
            start = time.perf_counter()
            try:
                await embed(client, sentence)
            except Exception as exc:  # counted and shown; the level goes on
                console.print(f"[red]request failed:[/] {exc}")
                errors += 1
                continue
            latencies.append(time.perf_counter() - start)

    try:
        before = await triton_statistics(client)
        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        inferences, executions = counts(before, await settled_statistics(client))
    finally:
        await client.close()
    return Level(
        name, concurrency, len(latencies), seconds, inferences, executions, errors, latencies
    )


def run_level(url: str, name: str, sentences: list[str], concurrency: int) -> Level:
    return asyncio.run(drive(url, name, sentences, concurrency))


def run_levels(repositories: dict[str, Path], sentences: list[str], levels, per_client, rounds):
    """Both Tritons up at once. At each concurrency the repositories take turns, in
    alternating order round after round (on, off, off, on, ...), so a change in the
    machine's load falls on both alike (an idle Triton costs next to nothing)."""
    from serve.engines.triton.launcher import TritonProcess

    results = []
    with ExitStack() as stack:
        servers = {}
        for name, path in repositories.items():
            log_file = stack.enter_context(path.with_suffix(".log").open("w"))
            server = TritonProcess(path).start(timeout_s=300, stdout=log_file)
            servers[name] = stack.enter_context(server)
        for name, server in servers.items():
            run_level(server.grpc_url, name, sentences[:16], 4)  # warm-up
        for c in levels:
            pooled = {name: Level(name, c) for name in servers}
            for r in range(rounds):
                for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
                    console.log(f"{name}: concurrency {c}, round {r + 1}/{rounds}")
                    batch = sentences[: c * per_client]
                    pooled[name].add(run_level(servers[name].grpc_url, name, batch, c))
            results += pooled.values()
    return results


# -- the report ---------------------------------------------------------------------


COLUMNS = ("run", "conc.", "reqs", "req/s", "x off", "p50 ms", "p99 ms", "mean batch", "errors")


def speedup(level: Level, base: Level) -> float:
    """The median over rounds of requests/s against the batching-off run of the same
    round: each pair ran back to back, so a burst of load elsewhere on the machine
    skews one pair, not the figure."""
    ratios = [a / b for a, b in zip(level.round_rates, base.round_rates, strict=True)]
    return median(ratios) if ratios else level.requests_per_s / base.requests_per_s


def rows(levels: list[Level]) -> list[tuple[str, ...]]:
    """Table rows by concurrency, batching off first; "x off": :func:`speedup`."""
    off = {lv.concurrency: lv for lv in levels if lv.name == "batching off"}
    table = []
    for level in sorted(levels, key=lambda lv: (lv.concurrency, lv.name != "batching off")):
        base = off.get(level.concurrency)
        table.append(
            (
                level.name,
                str(level.concurrency),
                str(level.requests),
                f"{level.requests_per_s:.0f}",
                f"{speedup(level, base):.2f}" if base else "",
                f"{level.p50_ms:.1f}",
                f"{level.p99_ms:.1f}",
                f"{level.mean_batch:.1f}",
                str(level.errors),
            )
        )
    return table


def report(levels: list[Level]) -> Table:
    table = Table(title="all-MiniLM-L6-v2 through Triton: dynamic batching on vs off")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "run" else "right")
    for row in rows(levels):
        table.add_row(*row)
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from build_engines.embeddings import EmbeddingsOptions
    from build_engines.targets.base import DynamicBatching

    defaults, batching = EmbeddingsOptions(), DynamicBatching()
    p = argparse.ArgumentParser(
        prog="python -m bench.embeddings",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--requests-per-client", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="turns per repository and level")
    p.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size)
    p.add_argument("--delay-us", type=int, default=batching.max_queue_delay_us)
    p.add_argument(
        "--preferred-batch-sizes",
        default=",".join(str(s) for s in batching.preferred_batch_sizes),
        help="comma-separated (empty: none)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scratch", type=Path, default=ROOT / "build" / "bench-embeddings")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    from build_engines.embeddings import EmbeddingsOptions
    from build_engines.targets.base import DynamicBatching

    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    preferred = tuple(int(s) for s in args.preferred_batch_sizes.split(",") if s.strip())
    on = EmbeddingsOptions(
        max_batch_size=args.max_batch_size,
        device="cpu",
        dynamic_batching=DynamicBatching(True, preferred, args.delay_us),
    )
    off = EmbeddingsOptions(
        max_batch_size=args.max_batch_size, device="cpu", dynamic_batching=DynamicBatching(False)
    )
    repositories = build_repositories(args.scratch, on, off)
    sentences = make_sentences(max(levels) * args.requests_per_client, args.seed)
    results = run_levels(repositories, sentences, levels, args.requests_per_client, args.rounds)
    console.print(report(results))
    out = args.scratch / "results.json"
    summary = {"options": {"on": asdict(on), "off": asdict(off)}, "levels": levels}
    runs = [level.summary() for level in results]
    out.write_text(json.dumps({**summary, "runs": runs}, indent=2) + "\n")
    console.log(f"wrote {out}; Triton's logs: {args.scratch}/*.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
