"""The composition root: ``build_app(args)`` is the Serve ``import_path`` target.

serve run serve/config.yaml          # local
serve deploy serve/config.yaml       # a running cluster (after ray start --head)
"""

from __future__ import annotations

from ray import serve

from serve.config import AppConfig
from serve.deployments.ingress import OpenAIIngress
from serve.deployments.triton_replica import TritonReplica


def build_app(args: dict | None = None):
    config = AppConfig.model_validate(args or {})
    replica = serve.deployment(TritonReplica).options(
        name="TritonReplica", **config.replica_options
    )
    ingress = serve.deployment(OpenAIIngress).options(
        name="OpenAIIngress", **config.ingress_options
    )
    return ingress.bind(replica.bind(config), config)
