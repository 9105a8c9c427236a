"""``make bench-fairness``: one tenant's flood against another's interactive load, and
priorities at saturation, with the ingress's fair shares on and off (serve/api/common/fairness.py).

One stack per setting, over the null engine (a benchmark instrument: no model math, a
fixed step time, real token ids; ``make bench-capacity`` says more), with a tenants file
of three tenants of weight 1. Its replica's autoscaling target (``--target``: the fair
queue's seats) is the engine's batch (``--max-batch-size``) unless given, as the app
sets it by default; a target below the batch leaves the rest of it as room.
The settings alternate, ``--rounds`` times (this machine's figures drift between runs;
ratios taken in one round hold). In each round, each phase ``--seconds`` long:

- ``alone``: tenant ``interactive``'s clients (closed loop, streamed completions);
- ``flood``: the same, while tenant ``batch`` keeps ten times its share of the seats
  in flight (``--flood-clients``): the interactive tenant's TTFT against ``alone``'s;
- ``priority``: tenant ``mixed`` at saturation, most of its clients at priority 5 and a
  few at 0 (vLLM's order: lower first): TTFT, the time a request waits for its first
  token, of the urgent ones against the others.

Writes ``results.json`` under ``--out`` and prints the tables and checks last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from bench.capacity import stack_config
from bench.common import ROOT, build_bench_repository, make_prompts, percentile, stop_on_sigterm
from bench.loadgen import OpenAITarget, RequestRecord
from bench.serving import MODEL, machine, serve_run

console = Console(soft_wrap=True, width=160)

TENANTS = {
    "tenants": [
        {"name": "interactive", "keys": ["bench-interactive"]},
        {"name": "batch", "keys": ["bench-batch"]},
        {"name": "mixed", "keys": ["bench-mixed"]},
    ]
}
LOW, HIGH = 5, 0  # the priority phase's two classes
# Before a phase's measured clients start: the load they meet has filled the seats.
WARM_S = 3.0


class TenantTarget(OpenAITarget):
    """Streamed completions with a tenant's key and, where given, a ``priority``."""

    def __init__(self, url: str, key: str, clients: int, priority: int | None = None):
        headers = {"Authorization": f"Bearer {key}"}
        super().__init__(key, url, MODEL, max_connections=clients, headers=headers)
        self.priority = priority

    def body(self, prompt: str, output_len: int) -> dict:
        body = super().body(prompt, output_len)
        if self.priority is not None:
            body["priority"] = self.priority
        return body


async def closed_loop(
    target: OpenAITarget, clients: int, prompts: list[str], output_len: int, until: float
) -> list[RequestRecord]:
    """``clients`` sending one request after another until ``until`` (perf_counter)."""
    records: list[RequestRecord] = []

    async def client(first: int) -> None:
        i = first
        while time.perf_counter() < until:
            records.append(await target.request(prompts[i % len(prompts)], output_len))
            i += clients

    await asyncio.gather(*(client(i) for i in range(clients)))
    await target.aclose()
    return records


def figures(records: list[RequestRecord], seconds: float, since: float) -> dict:
    """TTFT over the requests sent from ``since`` (perf_counter: the load they meet is
    warm); tokens/s over all, in ``seconds``."""
    ok = [r for r in records if r.ok]
    ttft = [1000 * (r.arrivals[0] - r.sent) for r in ok if r.sent >= since]
    return {
        "requests": len(records),
        "completed": len(ok),
        "refused": sum(r.rejected for r in records),
        "errors": sum(r.error is not None for r in records),
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p90_ms": percentile(ttft, 0.9),
        "tokens_per_s": sum(r.tokens for r in ok) / seconds,
    }


async def phase(url: str, args, prompts: list[str], loads: dict[str, tuple]) -> dict:
    """Each load (key, clients, priority, delay_s) run at once until the phase's end:
    the figures of each, its TTFT over the requests sent after ``WARM_S`` (a load
    delayed that long meets the others warm)."""
    start = time.perf_counter()
    until = start + WARM_S + args.seconds
    runs = {}
    for name, (key, clients, priority, delay_s) in loads.items():
        target = TenantTarget(url, key, clients, priority)

        async def delayed(target=target, clients=clients, delay_s=delay_s):
            await asyncio.sleep(delay_s)
            return await closed_loop(target, clients, prompts, args.output_len, until)

        runs[name] = delayed()
    done = dict(zip(runs, await asyncio.gather(*runs.values()), strict=True))
    seconds = time.perf_counter() - start
    return {
        name: figures(records, seconds - loads[name][3], start + WARM_S)
        for name, records in done.items()
    }


def bench_config(args, repository: Path, port: int, tenants_file: Path, fair: bool) -> dict:
    """One null-engine replica, autoscaling target ``args.target`` (the seats), the
    replica and the ingress open to every client (the fair queue, not Serve's limits,
    decides who waits), the tenants file, fair shares as ``fair``."""
    clients = args.flood_clients + args.interactive_clients + args.priority_clients
    config = stack_config(repository, port, clients, stream_interval_ms=0)
    app = config["applications"][0]["args"]
    (model,) = app["models"]
    deployment = model["deployment"]
    del deployment["num_replicas"]
    deployment["autoscaling_config"] = {
        "min_replicas": 1,
        "max_replicas": 1,
        "target_ongoing_requests": args.target,
    }
    deployment["max_ongoing_requests"] = 2 * args.max_batch_size
    deployment["max_queued_requests"] = 4 * clients
    app["ingress"]["max_ongoing_requests"] = 4 * clients
    app["api_keys"] = {"tenants_file": str(tenants_file)}
    app["fair_shares"] = fair
    return config


async def rounds_of(url: str, args, prompts: list[str]) -> dict:
    interactive = ("bench-interactive", args.interactive_clients, None, WARM_S)
    urgent = args.priority_clients // 8 or 1
    alone = await phase(url, args, prompts, {"interactive": interactive})
    flood = await phase(
        url,
        args,
        prompts,
        {"interactive": interactive, "batch": ("bench-batch", args.flood_clients, None, 0.0)},
    )
    priority = await phase(
        url,
        args,
        prompts,
        {
            "low": ("bench-mixed", args.priority_clients - urgent, LOW, 0.0),
            "high": ("bench-mixed", urgent, HIGH, WARM_S),
        },
    )
    return {
        "alone": alone,
        "flood": flood,
        "priority": priority,
        "interactive_ttft_ratio": flood["interactive"]["ttft_p50_ms"]
        / alone["interactive"]["ttft_p50_ms"],
        "priority_ttft_ratio": priority["high"]["ttft_p50_ms"] / priority["low"]["ttft_p50_ms"],
    }


def run(args) -> list[dict]:
    from serve.engines.triton.launcher import free_port

    repository = build_bench_repository(
        args.out / "scratch",
        args.max_batch_size,
        0,
        *("--target", "null", "--null-step-ms", str(args.step_ms)),
        *("--max-queue-size", str(4 * args.max_batch_size)),
    ).resolve()
    tenants_file = args.out / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump(TENANTS))
    prompts = make_prompts(64, args.prompt_words)
    results = []
    for round_ in range(1, args.rounds + 1):
        for fair in (True, False):
            name = f"fair-{'on' if fair else 'off'}-{round_}"
            config = bench_config(args, repository, free_port(), tenants_file, fair)
            with ExitStack() as stack:
                url = stack.enter_context(
                    serve_run(config, args.out, "throughput", ready_paths=("/health",), name=name)
                )
                console.log(f"round {round_}: fair shares {'on' if fair else 'off'} at {url}")
                result = asyncio.run(rounds_of(url, args, prompts))
            result |= {"round": round_, "fair_shares": fair}
            log_round(result)
            results.append(result)
    return results


def log_round(result: dict) -> None:
    flood = result["flood"]
    console.log(
        f"fair {'on ' if result['fair_shares'] else 'off'}: interactive TTFT p50 "
        f"{result['alone']['interactive']['ttft_p50_ms']:.0f} ms alone, "
        f"{flood['interactive']['ttft_p50_ms']:.0f} ms beside the flood "
        f"({result['interactive_ttft_ratio']:.2f}x); flood {flood['batch']['tokens_per_s']:.0f} "
        f"tok/s; priority TTFT p50 high/low {result['priority_ttft_ratio']:.2f}"
    )


def checks(results: list[dict]) -> list[dict]:
    """The issue's targets, in every round with fair shares on; and what they are off."""
    found = []
    for result in results:
        if not result["fair_shares"]:
            continue
        flood = result["flood"]
        found += [
            _check(f"round {result['round']}: interactive TTFT p50 beside the flood / alone",
                   result["interactive_ttft_ratio"], "<= 1.5",
                   result["interactive_ttft_ratio"] <= 1.5),
            _check(f"round {result['round']}: interactive requests refused or failed",
                   flood["interactive"]["refused"] + flood["interactive"]["errors"], "0",
                   flood["interactive"]["refused"] + flood["interactive"]["errors"] == 0),
            _check(f"round {result['round']}: priority 0 / priority 5 TTFT p50 at saturation",
                   result["priority_ttft_ratio"], "<= 0.3", result["priority_ttft_ratio"] <= 0.3),
        ]  # fmt: skip
    return found


def _check(name: str, value: float, target: str, passed: bool) -> dict:
    return {"name": name, "value": value, "target": target, "pass": passed}


def table(results: list[dict], title: str) -> Table:
    t = Table(title=title)
    for column in (
        "round", "fair shares", "interactive TTFT p50 alone ms", "beside the flood ms",
        "ratio", "interactive tok/s", "flood tok/s", "flood refused", "priority 0 TTFT p50 ms",
        "priority 5 TTFT p50 ms", "ratio",
    ):  # fmt: skip
        t.add_column(column, justify="right")
    for r in results:
        alone, flood, priority = r["alone"]["interactive"], r["flood"], r["priority"]
        t.add_row(
            str(r["round"]),
            "on" if r["fair_shares"] else "off",
            f"{alone['ttft_p50_ms']:.0f}",
            f"{flood['interactive']['ttft_p50_ms']:.0f}",
            f"{r['interactive_ttft_ratio']:.2f}",
            f"{flood['interactive']['tokens_per_s']:.0f}",
            f"{flood['batch']['tokens_per_s']:.0f}",
            str(flood["batch"]["refused"]),
            f"{priority['high']['ttft_p50_ms']:.0f}",
            f"{priority['low']['ttft_p50_ms']:.0f}",
            f"{r['priority_ttft_ratio']:.2f}",
        )
    return t


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.fairness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=2, help="fair shares on, then off, this often")
    p.add_argument("--seconds", type=float, default=20, help="each phase's measured time")
    p.add_argument("--step-ms", type=float, default=20, help="the null engine's step time")
    p.add_argument("--max-batch-size", type=int, default=16, help="sequences per engine step")
    p.add_argument(
        "--target",
        type=int,
        default=None,
        help="the replica's autoscaling target, the seats (default: the batch, as the app's)",
    )
    p.add_argument("--interactive-clients", type=int, default=2)
    p.add_argument(
        "--flood-clients",
        type=int,
        default=None,
        help="the flooding tenant's (default: ten times its share, half the seats)",
    )
    p.add_argument("--priority-clients", type=int, default=None, help="default: 5 x --target")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24, help="about 1.3 tokens per word")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench-fairness")
    args = p.parse_args(argv)
    if args.target is None:
        args.target = args.max_batch_size
    if args.flood_clients is None:
        args.flood_clients = 10 * max(1, args.target // 2)
    if args.priority_clients is None:
        args.priority_clients = 5 * args.target
    return args


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args)
    host = machine()
    data = {
        "command": " ".join(
            ["python -m bench.fairness", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": host,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "rounds": results,
        "checks": checks(results),
    }
    (args.out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    console.log(f"wrote {args.out / 'results.json'}")
    for check in data["checks"]:
        console.print(f"{'PASS' if check['pass'] else 'MISS'}  {check['name']}: "
                      f"{check['value']:.2f} (target {check['target']})")  # fmt: skip
    console.print(table(results, f"make bench-fairness: null engine, {args.step_ms:g} ms steps, "
                        f"batch {args.max_batch_size}, target {args.target}, {host['cores']} "
                        f"cores, {host['cpu']}"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
