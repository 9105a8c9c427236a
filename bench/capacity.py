"""``make bench-capacity``: what the serving path costs per token at GPU token rates, on a CPU.

A GPU box streams 10,000-30,000 tokens/s with almost no CPU in the engine, so the
CPU the serving path spends per token (Triton, pre/postprocessing, the replicas, the
proxy) decides how many cores one GPU needs. A CPU model cannot produce tokens that
fast; the null engine (``tritonllm/engine/null_engine.py``, ``build_engines --target
null``) can: the same scheduler and tensor contract with a sleep of ``--step-ms`` per
engine step instead of a forward pass, up to ``--max-batch-size`` sequences, real
token ids of the model's tokenizer. Everything it costs is serving overhead.

Two systems over the same null-engine repository, side by side in one run, at each
concurrency (64, 256, 512 streams) and each step time:

- ``triton``: Triton alone, the ensemble over gRPC streaming (bench/loadgen.py);
- ``stack``: this stack end to end (``serve run`` of serve/config.yaml's LLM, its
  Serve limits opened to the largest concurrency, as a GPU deployment sizes them).

Per level: delivered tokens/s, TTFT, ITL (gaps between chunks), TPOT (per token),
tokens per chunk, errors, 503s, and the CPU each process role spent per streamed
token (bench/cpu.py), the load generator's own apart. Several ``--step-ms`` values
give each system's saturation point: its highest tokens/s as the step time shrinks.
Writes ``results.json`` under ``--out`` and prints the tables last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from bench import cpu
from bench.common import ROOT, build_bench_repository, make_prompts, stop_on_sigterm
from bench.loadgen import OpenAITarget, TritonTarget, run_level
from bench.serving import MODEL, NicedTriton, machine, measured_level, serve_run
from serve.launch import SERVE_MODES

console = Console(soft_wrap=True, width=160)
SYSTEMS = ("triton", "stack")


def stack_config(
    repository: Path,
    port: int,
    max_concurrency: int,
    stream_interval_ms: float,
    layout: str = "ingress",
    stream_chunks_per_s: float | None = None,
) -> dict:
    """serve/config.yaml's LLM over ``repository``: one Triton replica, no autoscaling,
    and room for every stream (``max_ongoing_requests``) as a GPU deployment whose
    engine batches hundreds of sequences is sized; ``layout`` as the app's; the stream
    pacing given (None: the model's default)."""
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    model = next(m for m in args["models"] if m.get("task", "generate") == "generate")
    args["models"] = [model]
    args["layout"] = layout
    model["triton"]["model_repository"] = str(repository)
    if stream_interval_ms:
        model["stream_interval_ms"] = stream_interval_ms
    if stream_chunks_per_s is not None:
        model["stream_chunks_per_s"] = stream_chunks_per_s
    deployment = model["deployment"]
    deployment.pop("autoscaling_config", None)
    deployment |= {
        "num_replicas": 1,
        "max_ongoing_requests": max_concurrency,
        "max_queued_requests": max_concurrency,
    }
    args["ingress"]["max_ongoing_requests"] = 2 * max_concurrency
    return config


def cpu_figures(level: dict, system: str) -> dict:
    """CPU ms per delivered token by role, the serving path's total, and cores used."""
    tokens = round(level["output_tokens_per_s"] * level["seconds"])
    prefix = "triton:" if system == "triton" else ""
    spent = {
        role.removeprefix(prefix): seconds
        for role, seconds in level["cpu_s"].items()
        if role.startswith(prefix) or role == cpu.LOAD_GENERATOR
    }
    roles = [r for r in cpu.SERVING_PATH if r in spent]
    return {
        "cpu_ms_per_token": {r: cpu.ms_per_token(spent, tokens, [r]) for r in spent},
        "serving_ms_per_token": cpu.ms_per_token(spent, tokens, roles),
        "serving_cores": sum(spent[r] for r in roles) / level["seconds"],
    }


async def sweep(targets: dict, prompts: list[str], levels, output_len: int, triton_pid: int):
    results = []
    for target in targets.values():  # warm-up: connections, first loads
        await run_level(target, prompts[:8], 8, output_len)
    for concurrency, count in levels:
        for name in (n for n in SYSTEMS if n in targets):
            level = await measured_level(
                name, targets[name], prompts[:count], concurrency, output_len, triton_pid,
                os.getpid(),
            )  # fmt: skip
            level |= cpu_figures(level, name)
            results.append(level)
            log_level(level)
    for target in targets.values():
        await target.aclose()
    return results


def log_level(level: dict) -> None:
    serving = level["serving_ms_per_token"]
    console.log(
        f"{level['system']:>6} c={level['concurrency']:<4} {level['output_tokens_per_s']:8.0f} "
        f"tok/s  TTFT p50 {level['ttft_p50_ms']:6.0f} ms  {level['tokens_per_chunk']:.1f} "
        f"tok/chunk  errors {level['errors']}  503 {level['rejected_503']}  "
        + (f"serving {serving:.3f} CPU ms/token" if serving is not None else "")
        + (f"  {level['first_errors']}" if level["first_errors"] else "")
    )


def run_step(args, step_ms: float, levels, prompts: list[str]) -> list[dict]:
    """Both systems over a null-engine repository with this step time."""
    from serve.engines.triton.launcher import free_port

    scratch = ROOT / "build" / "bench-capacity" / f"step-{step_ms:g}ms"
    repository = build_bench_repository(
        scratch,
        args.max_batch_size,
        0,
        *("--target", "null", "--null-step-ms", str(step_ms)),
        *("--max-queue-size", str(max(c for c, _ in levels))),
    ).resolve()
    out = args.out / f"step-{step_ms:g}ms"
    out.mkdir(parents=True, exist_ok=True)
    systems = set(args.systems.split(","))
    max_concurrency = max(c for c, _ in levels)
    with ExitStack() as stack:
        targets, triton_pid = {}, None
        if "triton" in systems:
            log = stack.enter_context((out / "triton.log").open("w"))
            server = stack.enter_context(NicedTriton(repository).start(timeout_s=300, stdout=log))
            targets["triton"] = TritonTarget("triton", server.grpc_url)
            triton_pid = server.pid
        if "stack" in systems:
            config = stack_config(
                repository,
                free_port(),
                max_concurrency,
                args.stream_interval_ms,
                args.layout,
                args.stream_chunks_per_s,
            )
            url = stack.enter_context(
                serve_run(config, out, args.serve_mode, ready_paths=("/v1/models",))
            )
            targets["stack"] = OpenAITarget("stack", url, MODEL, max_connections=max_concurrency)
        console.log(f"step {step_ms:g} ms: {', '.join(targets)} over {repository}")
        results = asyncio.run(sweep(targets, prompts, levels, args.output_len, triton_pid))
    for level in results:
        level["step_ms"] = step_ms
    return results


def check_targets(results: list[dict], cores: int) -> list[dict]:
    """The serving path's CPU per token at 256 streams, and the stack against Triton
    alone at 256 streams and wherever Triton alone leaves the machine at least half idle."""
    checks = []
    for level in results:
        if level["system"] == "stack" and level["concurrency"] == 256:
            value = level["serving_ms_per_token"]
            checks.append(
                _check(f"stack serving CPU ms/token, 256 streams, step {level['step_ms']:g} ms",
                       value, "<= 0.2", value is not None and value <= 0.2)
            )  # fmt: skip
    by_key = {(r["system"], r["step_ms"], r["concurrency"]): r for r in results}
    for (system, step, c), alone in sorted(by_key.items()):
        stack = by_key.get(("stack", step, c))
        if system != "triton" or stack is None:
            continue
        if c != 256 and alone["serving_cores"] > cores / 2:
            continue
        ratio = stack["output_tokens_per_s"] / alone["output_tokens_per_s"]
        added = stack["ttft_p50_ms"] - alone["ttft_p50_ms"]
        where = f"step {step:g} ms, {c} streams"
        checks.append(_check(f"stack/triton tokens/s, {where}", ratio, ">= 0.9", ratio >= 0.9))
        checks.append(_check(f"TTFT p50 added, {where}", added, "<= 15 ms", added <= 15))
    return checks


def _check(name: str, value, target: str, passed: bool) -> dict:
    return {"name": name, "value": value, "target": target, "pass": bool(passed)}


def saturation(results: list[dict]) -> list[dict]:
    """Each system's highest delivered tokens/s at each step time."""
    best: dict[tuple, dict] = {}
    for r in results:
        key = (r["system"], r["step_ms"])
        if key not in best or r["output_tokens_per_s"] > best[key]["output_tokens_per_s"]:
            best[key] = r
    return [
        {"system": s, "step_ms": step, "tokens_per_s": r["output_tokens_per_s"],
         "concurrency": r["concurrency"]}
        for (s, step), r in sorted(best.items(), key=lambda kv: (-kv[0][1], kv[0][0]))
    ]  # fmt: skip


def levels_table(results: list[dict], title: str) -> Table:
    table = Table(title=title)
    columns = (
        "step", "system", "conc.", "out tok/s", "TTFT p50", "p99", "ITL p50", "p99",
        "TPOT p50", "tok/chunk", "err", "503", "serving CPU ms/tok", "cores",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "system" else "right")
    for r in results:
        serving = r["serving_ms_per_token"]
        table.add_row(
            f"{r['step_ms']:g}",
            r["system"],
            str(r["concurrency"]),
            f"{r['output_tokens_per_s']:.0f}",
            *(f"{r[k]:.0f}" for k in ("ttft_p50_ms", "ttft_p99_ms")),
            *(f"{r[k]:.1f}" for k in ("itl_p50_ms", "itl_p99_ms", "tpot_p50_ms")),
            f"{r['tokens_per_chunk']:.1f}",
            str(r["errors"]),
            str(r["rejected_503"]),
            "" if serving is None else f"{serving:.3f}",
            f"{r['serving_cores']:.2f}",
        )
    return table


def roles_table(results: list[dict]) -> Table:
    roles = [*cpu.SERVING_PATH, cpu.LOAD_GENERATOR]
    table = Table(title="CPU ms per streamed token, by process role")
    for column in ("step", "system", "conc.", *roles):
        table.add_column(column, justify="left" if column == "system" else "right")
    for r in results:
        figures = r["cpu_ms_per_token"]
        table.add_row(
            f"{r['step_ms']:g}",
            r["system"],
            str(r["concurrency"]),
            *("" if figures.get(role) is None else f"{figures[role]:.3f}" for role in roles),
        )
    return table


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--concurrency", default="64,256,512", help="comma-separated levels")
    p.add_argument("--step-ms", default="5", help="null engine step times, comma-separated")
    p.add_argument("--systems", default="triton,stack", help="any of triton, stack")
    p.add_argument("--max-batch-size", type=int, default=256, help="sequences per engine step")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24, help="about 1.3 tokens per word")
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=0,
        help="the stack model's stream_interval_ms (0: send what is ready, no waiting)",
    )
    p.add_argument(
        "--stream-chunks-per-s",
        type=float,
        default=None,
        help="the stack model's stream_chunks_per_s (default: the model's; 0: no shared "
        "chunk budget)",
    )
    p.add_argument(
        "--layout",
        choices=("ingress", "direct"),
        default="ingress",
        help="the stack's layout: an ingress in front of the replica, or the replica "
        "serving the API itself",
    )
    p.add_argument(
        "--serve-mode",
        choices=SERVE_MODES,
        default="throughput",
        help="throughput: as make run ships it; default: Ray Serve as it comes",
    )
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench-capacity")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    levels = [(c, c * args.requests_per_client) for c in concurrency]
    prompts = make_prompts(max(n for _, n in levels), args.prompt_words)
    results = []
    for step_ms in (float(s) for s in args.step_ms.split(",")):
        results += run_step(args, step_ms, levels, prompts)
    host = machine()
    data = {
        "command": " ".join(
            ["python -m bench.capacity", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": host,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "levels": results,
        "saturation": saturation(results),
        "targets": check_targets(results, host["cores"]),
    }
    (args.out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    console.log(f"wrote {args.out / 'results.json'}")
    for row in data["saturation"]:
        console.print(
            f"saturation: {row['system']} at step {row['step_ms']:g} ms: "
            f"{row['tokens_per_s']:.0f} tokens/s (c={row['concurrency']})"
        )
    for check in data["targets"]:
        value = check["value"]
        shown = "n/a" if value is None else f"{value:.3f}"
        console.print(f"{'PASS' if check['pass'] else 'MISS'}  {check['name']}: {shown} "
                      f"(target {check['target']})")  # fmt: skip
    console.print(roles_table(results))
    console.print(levels_table(results, f"make bench-capacity: {args.output_len} tokens/request, "
                               f"{host['cores']} cores, {host['cpu']}"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
