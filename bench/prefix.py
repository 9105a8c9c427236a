"""``make bench-prefix``: prefix caching and prefix-aware routing, side by side.

Two workloads on the ~30M bench model (2,048-token context), ``--workload``:

- ``conversations``: ``--conversations`` conversations, each its own long prefix
  (``--prefix-words`` words, ~1.3 tokens each) and ``--turns`` short turns; round ``t``
  sends turn ``t`` of every conversation, ``--concurrency`` at a time, so between two
  turns of one conversation every other conversation runs once (a replica that sees
  them all needs them all cached).
- ``tenants`` (cache pressure): ``--tenants`` tenants, each its own system prompt of
  ``--prefix-words`` words, ``--conversations`` conversations on each, ``--turns``
  turns; round ``t`` sends turn ``t`` of every conversation in a new random order.

Each replica's cache budget holds ``--budget-share`` of the workload's prefixes (the
conversations', the tenants' system prompts), counted with the model's tokenizer.

The applications of one ``serve run`` (``--systems``), two Triton replicas each:
``off`` (no prefix cache), ``on`` (the cache, Serve's default routing), ``routed`` (the
cache and ``routing: prefix_aware``), ``kv`` (the cache and ``routing: kv_aware``).
With ``--chunked-context N``, two more with chunked context on and N-token steps:
``off-chunked`` and ``routed-chunked`` (and ``kv-chunked`` where ``--systems`` names
it). Each of ``--shared-rounds`` rounds measures
every system one after the other on fresh prompts, the order rotated; the results
hold every round and the medians. Then a workload with no shared prefix on ``off``,
``on`` (the cache's cost when it never hits) and ``off-chunked``, alternated
``--rounds`` times. Prefill tokens computed and the hit rate (the prompt tokens
served from cache: what the API returns as ``usage.prompt_tokens_details.
cached_tokens``) come from the replicas' own Triton metrics, with the busiest
replica's share of the prompt tokens; each round also records its ideal hit rate (one
cache that never evicts: what no routing beats). Writes ``results.json``
under ``--out`` (docs/bench/prefix.json is one such run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from bench.common import (
    ROOT,
    WORDS,
    build_bench_repository,
    checkpoint_dir,
    make_prompts,
    set_engine_parameter,
    stop_on_sigterm,
)
from bench.loadgen import OpenAITarget, run_level, summarize
from bench.serving import serve_run
from serve.engines.triton.launcher import free_port
from serve.routing.kv_index import block_keys
from tritonllm.tokenization import load_tokenizer

console = Console(soft_wrap=True, width=150)
MODEL = "tritonllm-default"


@dataclass(frozen=True)
class System:
    """One application of the run: its engine's settings and its routing."""

    cache: bool
    routing: str = "default"
    chunked: bool = False  # chunked context (off: the build's default)


SYSTEMS = {
    "off": System(False),
    "on": System(True),
    "routed": System(True, "prefix_aware"),
    "kv": System(True, "kv_aware"),
    "kv-chunked": System(True, "kv_aware", chunked=True),  # with --chunked-context N
}
CHUNKED = {
    "off-chunked": System(False, chunked=True),
    "routed-chunked": System(True, "prefix_aware", chunked=True),
}
COUNTERS = {
    "prefill_tokens": "tritonllm_engine_prompt_tokens_total",
    "queried_tokens": "vllm:prefix_cache_queries_total",
    "hit_tokens": "vllm:prefix_cache_hits_total",
}
KV_BYTES_PER_TOKEN = 2 * 10 * 4 * 64 * 4  # bench model: K and V, 10 layers, 4 kv heads, fp32


def conversation_prompts(conversations: int, turns: int, prefix_words: int, seed: int = 0):
    """Round by round: turn t of every conversation (its prefix and t short questions).
    Another ``seed`` gives other conversations, sharing no prefix with these."""
    rng = random.Random(seed)
    prefixes = [
        f"Conversation {seed}-{c}. " + " ".join(rng.choice(WORDS) for _ in range(prefix_words))
        for c in range(conversations)
    ]
    questions = [
        [" ".join(rng.choice(WORDS) for _ in range(8)) + "?" for _ in range(turns)]
        for _ in range(conversations)
    ]
    return [
        prefixes[c] + "".join(f"\nUser: {q}" for q in questions[c][: t + 1])
        for t in range(turns)
        for c in range(conversations)
    ]


def tenant_prompts(
    tenants: int, conversations: int, turns: int, system_words: int, seed: int = 0
) -> tuple[list[str], list[str]]:
    """The cache-pressure workload: ``tenants`` system prompts of ``system_words``
    words, ``conversations`` conversations on each. Round by round, turn t of every
    conversation, the conversations in a new random order each round (a replica's
    cache sees every tenant between two turns of one). The prompts, and the tenants'
    system prompts (what the caches are sized by)."""
    rng = random.Random(seed)
    systems = [
        f"You are tenant {seed}-{t}'s assistant. " + " ".join(rng.choices(WORDS, k=system_words))
        for t in range(tenants)
    ]
    talks = [
        (systems[t], f"\nConversation {c}: " + " ".join(rng.choices(WORDS, k=12)))
        for t in range(tenants)
        for c in range(conversations)
    ]
    questions = [[" ".join(rng.choices(WORDS, k=8)) + "?" for _ in range(turns)] for _ in talks]
    prompts = []
    for turn in range(turns):
        order = list(range(len(talks)))
        rng.shuffle(order)
        for i in order:
            system, opening = talks[i]
            prompts.append(
                system + opening + "".join(f"\nUser: {q}" for q in questions[i][: turn + 1])
            )
    return prompts, systems


def workload(args, seed: int) -> tuple[list[str], list[str]]:
    """``--workload``'s prompts for one round, and the prefixes the caches are sized by."""
    if args.workload == "tenants":
        return tenant_prompts(args.tenants, args.conversations, args.turns, args.prefix_words, seed)
    prompts = conversation_prompts(args.conversations, args.turns, args.prefix_words, seed)
    return prompts, prompts[: args.conversations]  # every round's first turns are as long


def repositories(
    out: Path, systems: dict[str, System], prefixes: list[str], share: float, step: int
) -> tuple[dict, float]:
    """One build of the bench model, copied per app (each app's Tritons are found by
    their path): with the cache, a budget that holds ``share`` of the workload's
    prefixes, counted with the model's tokenizer; with chunked context, ``step``-token
    steps."""
    built = build_bench_repository(out / "build", 8, 0)
    tokenizer = load_tokenizer(str(checkpoint_dir(built)))
    prefix_tokens = sum(len(tokenizer.encode(t)) for t in prefixes)
    budget_mb = round(share * prefix_tokens * KV_BYTES_PER_TOKEN / 2**20, 1)
    repos = {}
    for app, system in systems.items():
        repos[app] = out / app / "model_repository"
        shutil.rmtree(repos[app], ignore_errors=True)
        shutil.copytree(built, repos[app], symlinks=True)
        set_engine_parameter(repos[app], "prefix_cache_mb", budget_mb if system.cache else 0)
        if system.chunked:
            set_engine_parameter(repos[app], "enable_chunked_context", "true")
            set_engine_parameter(repos[app], "max_num_tokens", step)
    return repos, budget_mb


def serve_config(systems: dict[str, System], repos: dict[str, Path], port: int) -> dict:
    shipped = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    base = shipped["applications"][0]
    model = next(m for m in base["args"]["models"] if m.get("task", "generate") == "generate")
    applications = []
    for name, system in systems.items():
        deployment = {**model["deployment"], "num_replicas": 2}
        deployment.pop("autoscaling_config", None)
        # Two replicas per system on a small machine: only two of them work at a time,
        # and all must fit the machine's CPUs, or some are never scheduled.
        deployment["ray_actor_options"] = {"num_cpus": round(0.5 / len(systems), 2)}
        llm = {**model, "triton": {"model_repository": str(repos[name])}}
        llm["routing"] = system.routing
        llm["deployment"] = deployment
        args = {**base["args"], "models": [llm]}
        applications.append({**base, "name": name, "route_prefix": f"/{name}", "args": args})
    return {
        **shipped,
        "http_options": {**shipped["http_options"], "port": port},
        "applications": applications,
    }


def triton_counters(repository: Path) -> dict[int, dict[str, float]]:
    """The prefix counters of each Triton serving ``repository``, by its pid."""
    counters = {}
    for pid in _tritons(repository):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        port = next(a.split(b"=")[1].decode() for a in cmdline if a.startswith(b"--metrics-port="))
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        counters[pid] = {key: samples.get(name, 0.0) for key, name in COUNTERS.items()}
    return counters


def counted(before: dict, after: dict) -> dict[str, float]:
    """What the Tritons counted between two :func:`triton_counters`, summed, and the
    busiest one's share of the prompt tokens (0.5 of two: the replicas were sent alike)."""
    deltas = [
        {key: c[key] - before.get(pid, {}).get(key, 0.0) for key in COUNTERS}
        for pid, c in after.items()
    ]
    totals = {key: sum(d[key] for d in deltas) for key in COUNTERS}
    busiest = max((d["queried_tokens"] for d in deltas), default=0.0)
    totals["busiest_replica_share"] = busiest / totals["queried_tokens"] if busiest else 0.0
    return totals


ROUTER_PUSH_S = 6  # more than the app's metrics push period


async def router_counters(app_url: str) -> dict[str, float]:
    """The kv_aware router's counters in the app's /metrics (empty: another routing),
    with the sum and count of its time choosing."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{app_url}/metrics", timeout=10)).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("tritonllm_kv_router_")
            if name != sample.name and name.endswith(("_total", "_seconds_sum", "_seconds_count")):
                key = name.removesuffix("_total")
                key += f":{sample.labels['how']}" if "how" in sample.labels else ""
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def _tritons(repository: Path) -> list[int]:
    mark = f"--model-repository={repository}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            continue
    return pids


async def measure(app: str, url: str, repo: Path, prompts, concurrency, output_len) -> dict:
    target = OpenAITarget(app, f"{url}/{app}", MODEL)
    await run_level(target, make_prompts(2, 20, seed=99), 2, 4)  # connections, first loads
    kv_aware = SYSTEMS.get(app, CHUNKED.get(app)).routing == "kv_aware"
    if kv_aware:  # the router's figures so far (the ingress pushes them every few s)
        await asyncio.sleep(ROUTER_PUSH_S)
    before, routed_before = triton_counters(repo), await router_counters(f"{url}/{app}")
    records, seconds = await run_level(target, prompts, concurrency, output_len)
    after = triton_counters(repo)
    await target.aclose()
    result = {"system": app, **summarize(records, seconds), **counted(before, after)}
    if kv_aware:  # how it routed
        await asyncio.sleep(ROUTER_PUSH_S)
        routed_after = await router_counters(f"{url}/{app}")
        result["router"] = {k: v - routed_before.get(k, 0.0) for k, v in routed_after.items()}
    queried = result["queried_tokens"]
    result["hit_rate"] = result["hit_tokens"] / queried if queried else 0.0
    console.log(
        f"{app:>7}: TTFT p50 {result['ttft_p50_ms']:.0f} ms p90 {result['ttft_p90_ms']:.0f} ms, "
        f"{result['output_tokens_per_s']:.1f} tok/s, prefill {result['prefill_tokens']:.0f}, "
        f"hit rate {result['hit_rate']:.2f}, busiest replica "
        f"{result['busiest_replica_share']:.2f}, errors {result['errors']}"
    )
    return result


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m bench.prefix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workload",
        choices=("conversations", "tenants"),
        default="conversations",
        help="conversations: each its own prefix; tenants: --tenants system prompts of "
        "--prefix-words words, --conversations conversations on each (cache pressure)",
    )
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--conversations", type=int, default=8, help="per tenant with tenants")
    p.add_argument(
        "--systems",
        default="off,on,routed,kv",
        help="the applications, of off, on, routed (prefix_aware), kv (kv_aware)",
    )
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prefix-words", type=int, default=900, help="~1,200 tokens")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument(
        "--budget-share",
        type=float,
        default=0.5,
        help="conversations one replica's cache holds, as a share of all",
    )
    p.add_argument("--unique-prompts", type=int, default=16, help="0: skip the no-prefix run")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="no-prefix runs of off, on (and off-chunked), alternated: drift hits them all",
    )
    p.add_argument(
        "--shared-rounds",
        type=int,
        default=1,
        help="shared-prefix runs of every system, each on fresh conversations, the "
        "systems' order rotated each round; the table is of medians",
    )
    p.add_argument("--skip-shared", action="store_true", help="the no-prefix runs only")
    p.add_argument(
        "--chunked-context",
        type=int,
        default=0,
        metavar="N",
        help="also off-chunked and routed-chunked: chunked context on, N-token steps",
    )
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench-prefix")
    return p.parse_args(argv)


def ideal_hit_rate(prompts: list[str], tokenizer, block_size: int = 16) -> float:
    """The share of the prompts' tokens one cache that never evicts would serve, the
    prompts sent one after the other: what no routing can beat."""
    seen, total, hits = set(), 0, 0
    for prompt in prompts:
        token_ids = tokenizer.encode(prompt)
        keys = block_keys(token_ids, block_size, None)
        held = next((i for i, key in enumerate(keys) if key not in seen), len(keys))
        total, hits = total + len(token_ids), hits + held * block_size
        seen.update(keys)
    return hits / total if total else 0.0


async def run(args, url: str, repos: dict[str, Path]) -> dict:
    shared = []
    apps = list(repos)
    tokenizer = load_tokenizer(str(checkpoint_dir(next(iter(repos.values())))))
    for round_ in range(0 if args.skip_shared else args.shared_rounds):
        prompts, _ = workload(args, seed=round_)
        ideal = ideal_hit_rate(prompts, tokenizer)
        console.log(f"round {round_}: one cache that never evicts would serve {ideal:.2f}")
        for app in apps[round_ % len(apps) :] + apps[: round_ % len(apps)]:
            result = await measure(app, url, repos[app], prompts, args.concurrency, args.output_len)
            shared.append({**result, "round": round_, "ideal_hit_rate": ideal})
    unique = []
    if args.unique_prompts:
        for round_ in range(args.rounds):
            fresh = make_prompts(args.unique_prompts, 250, seed=7 + round_)  # never cached
            for app in [a for a in ("off", "on", "off-chunked") if a in repos]:
                result = await measure(
                    app, url, repos[app], fresh, args.concurrency, 4 * args.output_len
                )
                unique.append({**result, "round": round_})
    results = {
        "shared_prefix": shared,
        "shared_prefix_medians": _medians(shared, apps),
        "no_shared_prefix": unique,
        "no_shared_prefix_on_over_off": _median_ratio(unique, "output_tokens_per_s"),
    }
    if "off-chunked" in repos:  # what chunked context costs where nothing hits
        results["no_shared_prefix_off_chunked_over_off"] = _median_ratio(
            unique, "output_tokens_per_s", "off-chunked", "off"
        )
    return results


def _medians(results: list[dict], apps: list[str]) -> dict[str, dict[str, float]]:
    """Per system, the median over its rounds of each figure of the table."""
    keys = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "output_tokens_per_s")
    keys += ("prefill_tokens", "hit_rate", "busiest_replica_share")
    medians = {}
    for app in apps:
        rounds = [r for r in results if r["system"] == app]
        if rounds:
            medians[app] = {k: statistics.median(r[k] for r in rounds) for k in keys}
    return medians


def _median_ratio(results: list[dict], key: str, over: str = "on", under: str = "off"):
    """Median of ``over``'s rounds over median of ``under``'s (None: either is missing)."""
    under_values = [r[key] for r in results if r["system"] == under]
    over_values = [r[key] for r in results if r["system"] == over]
    if not (under_values and over_values):
        return None
    return statistics.median(over_values) / statistics.median(under_values)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    args = parse_args(argv)
    # Absolute: the replicas' Tritons are found by the repository path on their
    # command lines, which Serve's config makes absolute.
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    _, prefixes = workload(args, seed=0)  # every round's are about as long
    systems = {name: SYSTEMS[name] for name in args.systems.split(",")}
    systems |= CHUNKED if args.chunked_context else {}
    repos, budget_mb = repositories(
        args.out, systems, prefixes, args.budget_share, args.chunked_context
    )
    config = serve_config(systems, repos, free_port())
    ready = tuple(f"/{app}/v1/models" for app in systems)
    with serve_run(config, args.out, "default", ready_paths=ready) as url:
        results = asyncio.run(run(args, url, repos))
    results["workload"] = {
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "budget_mb_per_replica": budget_mb,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    console.print_json(json.dumps(results["workload"]))
    console.print_json(json.dumps(results["shared_prefix_medians"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
