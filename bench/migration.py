"""``make bench-migration``: the gap a client sees when its stream moves to another replica.

One ``serve run`` of two applications of the ~30M bench model, two Triton replicas
each: ``cache-on`` (the engine's prefix cache) and ``cache-off``. The prompts share a
long system prefix (``--prefix-words``), as a chat application's do, each with a
question of its own. Each round, for each application in turn: ``--streams`` greedy
streams of ``--output-len`` tokens; once every stream has streamed ``--cut-after``
chunks, one replica's process is SIGKILLed and its streams resume on the other
(serve/migration.py), which prefills the prompt and the tokens sent so far again (with
the cache: all but the shared prefix it holds). The next round starts once the lost
replica is replaced.

Per stream the client stamps each text chunk and keeps its gap across the kill. The
app's ``tritonllm_request_migrations_total`` says how many streams moved; theirs are the
longest of those gaps (a re-route and a prefill), reported (median, max) beside the
gap across the kill of the streams that stayed (their replica takes the moved streams'
prefills) and the inter-token latency otherwise. Streams that failed are counted (0
expected). On a small machine the lost replica's replacement starts meanwhile and
takes CPU from the survivor. Writes ``results.json`` under ``--out``
(docs/bench/migration.json is one such run).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from bench.common import ROOT, make_prompts, stop_on_sigterm
from bench.prefix import System, _tritons, repositories, serve_config
from bench.serving import serve_run
from serve.engines.triton.launcher import free_port
from serve.metrics import PUSH_PERIOD_S

console = Console(soft_wrap=True, width=150)
MODEL = "tritonllm-default"
SYSTEMS = {
    "cache-on": System(cache=True, routing="default"),
    "cache-off": System(cache=False, routing="default"),
}


@dataclass
class Stream:
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each text chunk
    error: str | None = None


async def read_stream(client: httpx.AsyncClient, app: str, prompt: str, tokens: int, into):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens}
    body |= {"temperature": 0, "stream": True}
    try:
        async with client.stream("POST", f"/{app}/v1/completions", json=body) as response:
            if response.status_code != 200:
                into.error = f"HTTP {response.status_code}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    into.error = event["error"]["message"]
                elif any(c["text"] for c in event["choices"]):
                    into.arrivals.append(time.monotonic())
    except httpx.HTTPError as error:
        into.error = repr(error)


def replica_of(triton_pid: int) -> int:
    """The Serve replica that started this Triton (its parent process)."""
    stat = Path(f"/proc/{triton_pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


async def two_replicas_ready(repository: Path, timeout_s: float = 300) -> None:
    """Until two Tritons serve ``repository``, each with its models ready (the lost
    replica replaced), and Serve has had a moment to route to the new one."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as client:
        while not await _ready(client, _tritons(repository)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{repository}: not two ready Tritons within {timeout_s} s")
            await asyncio.sleep(0.5)
    await asyncio.sleep(3)  # the replica's __init__ returns, its controller marks it RUNNING


async def _ready(client: httpx.AsyncClient, tritons: list[int]) -> bool:
    if len(tritons) != 2:
        return False
    for pid in tritons:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        port = next(a.split(b"=")[1].decode() for a in args if a.startswith(b"--http-port="))
        try:
            # The server's readiness (Triton's strict readiness: every model it loaded
            # ready): a replica's Triton may load the engine step alone, no ensemble.
            ready = await client.get(f"http://127.0.0.1:{port}/v2/health/ready")
        except httpx.HTTPError:
            return False
        if ready.status_code != 200:
            return False
    return True


async def round_of(client, app: str, repository: Path, prompts: list[str], args) -> dict:
    before = await migrations(client, app)
    streams = [Stream() for _ in prompts]
    tasks = [
        asyncio.create_task(read_stream(client, app, p, args.output_len, s))
        for p, s in zip(prompts, streams, strict=True)
    ]
    while not all(len(s.arrivals) >= args.cut_after or s.error for s in streams):
        await asyncio.sleep(0.01)
    victim = replica_of(_tritons(repository)[0])
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    await asyncio.gather(*tasks)
    await two_replicas_ready(repository)
    moved = int(await migrations(client, app) - before)
    # Each stream's gap across the kill: the moved streams' are the longest (a re-route
    # and a prefill of the prompt and the tokens so far); the others' is a hiccup (the
    # moved streams' prefills join their replica's batch).
    across, others = [], []
    for stream in streams:
        gaps = list(itertools.pairwise(stream.arrivals))
        for before_kill, after_kill in gaps:
            if before_kill <= killed_at <= after_kill:
                across.append(after_kill - before_kill)
            else:
                others.append(after_kill - before_kill)
    across.sort(reverse=True)
    result = {
        "system": app,
        "streams": len(streams),
        "moved": moved,
        "failed": sum(s.error is not None for s in streams),
        "gap_p50_ms": _ms(statistics.median(across[:moved])) if moved else None,
        "gap_max_ms": _ms(across[0]) if moved else None,
        "not_moved_gap_p50_ms": _ms(statistics.median(across[moved:])) if across[moved:] else None,
        "itl_p50_ms": _ms(statistics.median(others)),
    }
    console.log(result)
    return result


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 1)


async def migrations(client: httpx.AsyncClient, app: str) -> float:
    """The app's resumed moves so far (its /metrics: every ingress replica's, pushed to
    the app's collector every few seconds)."""
    await asyncio.sleep(PUSH_PERIOD_S + 1)
    text = (await client.get(f"/{app}/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tritonllm_request_migrations_total"
        and sample.labels.get("outcome") == "resumed"
    )


def _medians(results: list[dict], app: str) -> dict:
    mine = [r for r in results if r["system"] == app and r["moved"]]
    keys = ("gap_p50_ms", "gap_max_ms", "not_moved_gap_p50_ms", "itl_p50_ms")
    return {key: statistics.median(r[key] for r in mine if r[key] is not None) for key in keys} | {
        "moved": sum(r["moved"] for r in mine),
        "failed": sum(r["failed"] for r in results if r["system"] == app),
    }


async def run(args, url: str, repos: dict[str, Path]) -> dict:
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        for app in repos:  # the engines' first requests, the connections
            await read_stream(client, app, "warm up", 8, Stream())
        for round_ in range(args.rounds):
            questions = make_prompts(args.streams, 12, seed=100 + round_)
            prefix = make_prompts(1, args.prefix_words, seed=round_)[0]
            prompts = [f"{prefix}\nQuestion: {q}" for q in questions]
            for app in list(repos)[round_ % 2 :] + list(repos)[: round_ % 2]:
                results.append({**await round_of(client, app, repos[app], prompts, args)})
    return {"rounds": results, "medians": {app: _medians(results, app) for app in repos}}


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m bench.migration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--cut-after", type=int, default=64, help="chunks every stream has had")
    p.add_argument("--prefix-words", type=int, default=700, help="~900 tokens shared")
    p.add_argument("--rounds", type=int, default=3, help="each system's, alternated")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench-migration")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    args = parse_args(argv)
    args.out = args.out.resolve()  # the replicas' Tritons are found by this path
    args.out.mkdir(parents=True, exist_ok=True)
    # A cache budget that holds the shared prefix and every stream's own tail.
    first_turns = [make_prompts(1, args.prefix_words)[0]] * 2
    repos, _ = repositories(args.out, SYSTEMS, first_turns, 4.0, 0)
    config = serve_config(SYSTEMS, repos, free_port())
    ready = tuple(f"/{app}/v1/models" for app in SYSTEMS)
    with serve_run(config, args.out, "default", ready_paths=ready) as url:
        results = asyncio.run(run(args, url, repos))
    results["workload"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    console.print_json(json.dumps(results["medians"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
