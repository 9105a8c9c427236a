"""``serve/config.yaml`` for a container or a cluster: the one Serve config, adapted.

``python -m serve.deploy_config --gpus-per-replica 1 -o /tmp/serve.yaml`` writes what
``serve deploy`` gets in docker/compose.yaml; the RayService in
docker/kuberay/rayservice.yaml carries the same config (a unit test compares them;
``--update-rayservice`` rewrites it after serve/config.yaml changes). Only what a
container changes is changed: the proxy listens on 0.0.0.0 on every node, and each
Triton replica reserves its GPUs. ``--responses-redis-url-env NAME`` also keeps stored
responses in the Redis whose URL the variable NAME holds; the RayService's config does,
with :data:`KUBERAY_RESPONSES_REDIS_URL_ENV` (the Redis of its GCS fault tolerance).
``--spread-over-nodes`` (the RayService's config too) keeps serving on the workers when
the head or a worker is lost: :func:`spread_over_nodes`.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

SERVE_CONFIG = Path(__file__).with_name("config.yaml")
RAYSERVICE = Path(__file__).resolve().parent.parent / "docker" / "kuberay" / "rayservice.yaml"
# The variable the RayService's pods set to the Redis URL of the stored responses
# (docker/kuberay/rayservice.yaml builds it from the GCS's Redis and its password).
KUBERAY_RESPONSES_REDIS_URL_ENV = "TRITONLLM_RESPONSES_REDIS_URL"


def load_base(path: Path = SERVE_CONFIG) -> dict:
    return yaml.safe_load(path.read_text())


def deploy_config(
    base: dict,
    gpus_per_replica: float = 1,
    port: int = 8000,
    responses_redis_url_env: str | None = None,
    spread: bool = False,
) -> dict:
    """``base`` with the proxy on 0.0.0.0:``port`` everywhere and GPUs per replica; with
    ``responses_redis_url_env``, every app stores responses in the Redis whose URL that
    environment variable holds; with ``spread``, :func:`spread_over_nodes`."""
    config = copy.deepcopy(base)
    config["proxy_location"] = "EveryNode"
    config["http_options"] = {**config.get("http_options", {}), "host": "0.0.0.0", "port": port}
    for app in config["applications"]:
        args = app.setdefault("args", {})
        for actor in triton_actor_options(args):
            _set_gpus(actor, gpus_per_replica)
        if responses_redis_url_env:
            _store_responses_in_redis(args, responses_redis_url_env)
    return spread_over_nodes(config) if spread else config


# What a cluster that survives the loss of its head or of one worker needs: an ingress
# replica beside the proxy of each of two workers at least, and the LLM's replicas on
# two of them.
SPREAD_REPLICAS = 2
# The ingress asks for CPU so that it never lands on a head started with
# `--num-cpus=0` (Ray places a replica that asks for none there too); it serves the
# node's HTTP itself behind HAProxy (serve/launch.py), a core's work under load.
SPREAD_INGRESS_CPUS = 1


def spread_over_nodes(config: dict) -> dict:
    """``config`` (changed in place, and returned) for a cluster whose head runs no
    replica (``--num-cpus=0``): at least :data:`SPREAD_REPLICAS` ingress replicas, one
    per node, each asking for CPUs; each generate model at least as many replicas, one
    per node. A worker's loss then leaves an ingress and an LLM replica serving, and
    the head's loss (the GCS, Serve's controller) none (docs/operations.md)."""
    for app in config["applications"]:
        args = app.setdefault("args", {})
        ingress = args.setdefault("ingress", {})
        ingress["num_replicas"] = max(ingress.get("num_replicas", 1), SPREAD_REPLICAS)
        ingress["max_replicas_per_node"] = 1
        actor = ingress.setdefault("ray_actor_options", {})
        actor["num_cpus"] = max(actor.get("num_cpus", 0), SPREAD_INGRESS_CPUS)
        for model in args["models"]:
            if model.get("task", "generate") != "generate":
                continue
            deployment = model.setdefault("deployment", {})
            deployment["max_replicas_per_node"] = 1
            scaling = deployment.get("autoscaling_config")
            if deployment.get("num_replicas") is not None:
                deployment["num_replicas"] = max(deployment["num_replicas"], SPREAD_REPLICAS)
            elif scaling is not None:
                scaling["min_replicas"] = max(scaling.get("min_replicas", 1), SPREAD_REPLICAS)
                scaling["max_replicas"] = max(
                    scaling.get("max_replicas", 1), scaling["min_replicas"]
                )
            else:
                deployment["num_replicas"] = SPREAD_REPLICAS
    return config


def triton_actor_options(args: dict) -> list[dict]:
    """The ``ray_actor_options`` of the LLM's Triton replicas in AppConfig's args, one
    per generate model (``models[].deployment``). Embeddings models stay on CPU: a
    GPU each would idle next to an LLM that needs it."""
    return [
        model.setdefault("deployment", {}).setdefault("ray_actor_options", {})
        for model in args["models"]
        if model.get("task", "generate") == "generate"
    ]


def _set_gpus(actor: dict, gpus_per_replica: float) -> None:
    if gpus_per_replica:
        whole = float(gpus_per_replica).is_integer()
        actor["num_gpus"] = int(gpus_per_replica) if whole else gpus_per_replica
    else:
        actor.pop("num_gpus", None)


def _store_responses_in_redis(args: dict, url_env: str) -> None:
    # The URL comes from the environment so the password stays out of serveConfigV2;
    # a redis_url of the base would be a second URL, which ResponsesConfig refuses.
    responses = {k: v for k, v in args.get("responses", {}).items() if k != "redis_url"}
    args["responses"] = {**responses, "store": "redis", "redis_url_env": url_env}


def update_rayservice(path: Path, config: dict) -> bool:
    """Rewrite the ``serveConfigV2`` block of a RayService manifest; True if it changed."""
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.strip() == "serveConfigV2: |") + 1
    end = start
    while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
        end += 1
    block = yaml.safe_dump(config, sort_keys=False).splitlines()
    new = [*lines[:start], *(f"    {line}\n" for line in block), *lines[end:]]
    if new == lines:
        return False
    path.write_text("".join(new))
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve.deploy_config", description=__doc__)
    p.add_argument("--base", type=Path, default=SERVE_CONFIG, help="the Serve config to adapt")
    p.add_argument("--gpus-per-replica", type=float, default=1, help="0 on a CPU-only cluster")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--responses-redis-url-env",
        metavar="NAME",
        help="store responses in the Redis whose URL the environment variable NAME holds",
    )
    p.add_argument(
        "--spread-over-nodes",
        action="store_true",
        help="ingress and LLM replicas on two nodes at least, one per node (a head "
        "started with --num-cpus=0 runs none)",
    )
    p.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    p.add_argument(
        "--update-rayservice",
        action="store_true",
        help=f"rewrite serveConfigV2 in {RAYSERVICE.relative_to(RAYSERVICE.parents[2])} "
        f"(responses in Redis, URL in {KUBERAY_RESPONSES_REDIS_URL_ENV}; spread over nodes)",
    )
    args = p.parse_args(argv)
    if args.update_rayservice:
        args.responses_redis_url_env = KUBERAY_RESPONSES_REDIS_URL_ENV
        args.spread_over_nodes = True
    config = deploy_config(
        load_base(args.base),
        args.gpus_per_replica,
        args.port,
        args.responses_redis_url_env,
        args.spread_over_nodes,
    )
    if args.update_rayservice:
        changed = update_rayservice(RAYSERVICE, config)
        print(f"{RAYSERVICE}: {'updated' if changed else 'already current'}")
        return 0
    text = yaml.safe_dump(config, sort_keys=False)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
