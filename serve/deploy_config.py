"""``serve/config.yaml`` for a container or a cluster: the one Serve config, adapted.

``python -m serve.deploy_config --gpus-per-replica 1 -o /tmp/serve.yaml`` writes what
``serve deploy`` gets in docker/compose.yaml; the RayService in
docker/kuberay/rayservice.yaml carries the same applications (a unit test compares
them). Only what a container changes is changed: the proxy listens on 0.0.0.0 on
every node, and each Triton replica reserves its GPUs.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

SERVE_CONFIG = Path(__file__).with_name("config.yaml")
TRITON_DEPLOYMENT_ARGS = "replica_options"  # AppConfig's Serve options of TritonReplica


def load_base(path: Path = SERVE_CONFIG) -> dict:
    return yaml.safe_load(path.read_text())


def deploy_config(base: dict, gpus_per_replica: float = 1, port: int = 8000) -> dict:
    """``base`` with the proxy on 0.0.0.0:``port`` everywhere and GPUs per replica."""
    config = copy.deepcopy(base)
    config["proxy_location"] = "EveryNode"
    config["http_options"] = {**config.get("http_options", {}), "host": "0.0.0.0", "port": port}
    for app in config["applications"]:
        options = app.setdefault("args", {}).setdefault(TRITON_DEPLOYMENT_ARGS, {})
        actor = options.setdefault("ray_actor_options", {})
        if gpus_per_replica:
            whole = float(gpus_per_replica).is_integer()
            actor["num_gpus"] = int(gpus_per_replica) if whole else gpus_per_replica
        else:
            actor.pop("num_gpus", None)
    return config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve.deploy_config", description=__doc__)
    p.add_argument("--base", type=Path, default=SERVE_CONFIG, help="the Serve config to adapt")
    p.add_argument("--gpus-per-replica", type=float, default=1, help="0 on a CPU-only cluster")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    args = p.parse_args(argv)
    config = deploy_config(load_base(args.base), args.gpus_per_replica, args.port)
    text = yaml.safe_dump(config, sort_keys=False)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
