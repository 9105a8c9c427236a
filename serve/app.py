"""The composition root: ``build_app(args)`` is the Serve ``import_path`` target.

serve run serve/config.yaml          # local
serve deploy serve/config.yaml       # a running cluster (after ray start --head)

Each model of the config gets its own deployment of Triton replicas (its own
resources, autoscaling and limits); one OpenAI ingress routes to them by the
request's ``model``. With ``layout: direct`` the one model's replicas serve the API
themselves (serve/deployments/direct.py).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from serve.api.common.keyring import load_tenants
from serve.config import AppConfig, ModelConfig
from serve.deployments.direct import DirectReplica
from serve.deployments.ingress import OpenAIIngress
from serve.deployments.metrics_collector import MetricsCollector
from serve.deployments.response_store import ResponseStoreReplica
from serve.engines.triton import repository
from serve.engines.triton.replica import TritonReplica
from serve.engines.vllm import deployment as vllm_deployment
from tritonllm import contract

log = logging.getLogger("ray.serve")


def build_app(args: dict | None = None):
    config = servable(AppConfig.model_validate(args or {}))
    check_tenants_file(config)
    if warning := counts_per_replica(config):
        log.warning(warning)
    collector = serve.deployment(MetricsCollector).options(**COLLECTOR_OPTIONS).bind()
    if config.layout == "direct":  # the model's replicas are the ingress
        (model,) = config.models
        deployment = serve.deployment(DirectReplica).options(**replica_options(model))
        return deployment.bind(model, config, collector, response_store(config))
    replicas = {}
    for model in config.models:
        if model.engine == "vllm":
            replicas[model.id] = vllm_deployment.build(model, replica_options(model))
            continue
        deployment = serve.deployment(TritonReplica).options(**replica_options(model))
        replicas[model.id] = deployment.bind(model, metrics_collector=collector)
    ingress = serve.deployment(OpenAIIngress).options(**ingress_options(config))
    return ingress.bind(replicas, config, collector, response_store(config), fair_seats(config))


def counts_per_replica(config: AppConfig) -> str | None:
    """Why the tenants' limits will not hold as written, or None: with the counts in
    memory (``rate_limits.store: memory``) each ingress replica counts alone, so with
    several a tenant gets its requests and tokens per minute from each of them."""
    replicas = config.ingress.num_replicas
    tenants = config.api_keys.tenants_file is not None
    if not tenants or config.rate_limits.store != "memory" or replicas == 1:
        return None
    return (
        f"rate_limits.store: memory with {replicas} ingress replicas: each counts alone, so "
        f"a tenant's requests and tokens per minute hold per replica (up to {replicas}x "
        "its limits in all); set rate_limits.store: redis for one count across them"
    )


def check_tenants_file(config: AppConfig) -> None:
    """A tenants file that is wrong fails the deploy here, with its line, rather than
    at each ingress replica's start (which Serve retries before it gives up). Checked
    where the file is: the ingress replicas' nodes must have it, this one may not."""
    path = config.api_keys.tenants_file
    if path is not None and path.expanduser().exists():
        load_tenants(path, [model.id for model in config.models])


def response_store(config: AppConfig):
    """The bound memory store every ingress replica shares (None: another store, or none)."""
    if config.responses.store != "memory":
        return None
    deployment = serve.deployment(ResponseStoreReplica).options(**RESPONSE_STORE_OPTIONS)
    return deployment.bind(config.responses.max_memory_bytes(), config.responses.ttl_s)


# A share of a CPU no node lacks, so that these replicas, like every other, stay off a
# head started with `--num-cpus=0`, which a cluster may lose (an actor that asks for no
# CPU fits on any node, that head included): docker/kuberay/rayservice.yaml.
TOKEN_CPUS = 0.01


# One replica holds the latest metrics of every process (serve/metrics.py says why);
# pushes and scrapes are short calls, so many may run at once.
COLLECTOR_OPTIONS = {
    "name": "MetricsCollector",
    "num_replicas": 1,
    "max_ongoing_requests": 1000,
    "ray_actor_options": {"num_cpus": TOKEN_CPUS},
}


# The memory store is one replica, so that every ingress replica sees each record;
# its calls are short (a dict lookup), so many may run at once.
RESPONSE_STORE_OPTIONS = {
    "name": "ResponseStore",
    "num_replicas": 1,
    "max_ongoing_requests": 1000,
    "ray_actor_options": {"num_cpus": TOKEN_CPUS},
}


def servable(config: AppConfig) -> AppConfig:
    """``config`` without its ``optional`` models whose repository is not built (each
    named in the log); any other unbuilt repository fails in :func:`replica_options`."""
    kept = []
    for model in config.models:
        try:
            if model.optional and model.engine == "triton":
                repository.check_built(model.triton.repository_path(), tuple(model.entry_models()))
        except repository.RepositoryError as error:
            log.warning("model %s left out (optional: true): %s", model.id, error)
            continue
        kept.append(model)
    if not any(m.task == "generate" for m in kept):
        raise repository.RepositoryError("no generate model is left to serve (see the log)")
    return config.model_copy(update={"models": kept})


def replica_options(model: ModelConfig) -> dict[str, Any]:
    """Serve options of one model's replicas, from its config and (Triton) its repository."""
    if model.engine == "triton":
        repository.check_built(model.triton.repository_path(), tuple(model.entry_models()))
        check_gpu_memory(model)
    options = model.deployment.model_dump(
        # access_log: the replica's own (TritonReplica), not one of Serve's options
        exclude={"num_replicas", "autoscaling_config", "ray_actor_options", "access_log"},
        exclude_none=True,
    )
    options["graceful_shutdown_timeout_s"] = model.drain_timeout_s()
    options["max_ongoing_requests"] = max_ongoing_requests(model)
    options["ray_actor_options"] = model.deployment.ray_actor_options.to_ray()
    if model.deployment.num_replicas is not None:
        options["num_replicas"] = model.deployment.num_replicas
    else:
        options["autoscaling_config"] = autoscaling(model)
    if model.routing == "prefix_aware":
        options["request_router_config"] = prefix_aware_router(model)
    elif model.routing == "kv_aware":
        options["request_router_config"] = kv_aware_router(model)
    return {"name": model.deployment_name(), **options}


# Ray's PrefixCacheAffinityRouter kept within Serve's multiplexing (serve/routing/prefix_aware.py
# says what Ray's own class gets wrong for variants). It reads the ``prompt`` of the
# call's first argument: GenerateParams has one.
PREFIX_AWARE_ROUTER = "serve.routing.prefix_aware.VariantPrefixRouter"


def prefix_aware_router(model: ModelConfig) -> RequestRouterConfig:
    """Prefix affinity while replicas' loads stay within one engine batch of each other
    (Ray's default threshold is infinite: never balance), else power of two choices.
    The router's prefix tree is bounded (it keeps no limit unless told)."""
    return RequestRouterConfig(
        request_router_class=PREFIX_AWARE_ROUTER,
        request_router_kwargs={
            "imbalanced_threshold": _batch_size(model),
            "do_eviction": True,  # at Ray's 400,000 characters
        },
    )


def kv_aware_router(model: ModelConfig) -> RequestRouterConfig:
    """Routing by the engines' KV cache events (serve/routing/kv_aware.py), balancing
    past one engine batch as prefix_aware does. Replicas report where their events are
    through Serve's routing stats, polled every 2 s here (Serve's default, 10 s, would
    leave a new replica out of the index that long). A model whose engine publishes no
    events (TensorRT-LLM's, the null engine, the prefix cache off) routes as
    prefix_aware, and says so at deploy."""
    path, engine = model.triton.repository_path(), model.engine_model()
    if repository.kv_event_block_size(path, engine) is None:
        log.warning(
            "routing: kv_aware: model %s's engine publishes no KV cache events (not the "
            "torch engine, or its prefix cache off): it routes as prefix_aware",
            model.id,
        )
        return prefix_aware_router(model)
    return RequestRouterConfig(
        request_router_class=KV_AWARE_ROUTER,
        request_router_kwargs={
            "model": model.id,
            "repository_dir": str(model.triton.repository_path()),
            "imbalanced_threshold": _batch_size(model),
        },
        request_routing_stats_period_s=2,
    )


KV_AWARE_ROUTER = "serve.routing.kv_aware.KvAwareRouter"


# What the engines of one replica may take together: the rest is for activations, CUDA
# graphs and the context, which TensorRT-LLM does not count in the fraction.
GPU_MEMORY_SHARE = 0.95


def check_gpu_memory(model: ModelConfig) -> None:
    """Refuse a replica whose engines would reserve more than its GPU: each TensorRT-LLM
    engine takes its KV-cache fraction of the GPU when it loads, and a pool of variants
    loads up to ``max_models_per_replica`` engines on the replica's one GPU."""
    if model.task != "generate" or not model.deployment.ray_actor_options.num_gpus:
        return
    path = model.triton.repository_path()
    engines = [contract.variant_engine(v) for v in model.variants] or [model.engine_model()]
    fractions = [f for f in (repository.kv_cache_fraction(path, e) for e in engines) if f]
    together = sorted(fractions, reverse=True)[: model.max_models_per_replica]
    if sum(together) > GPU_MEMORY_SHARE:
        raise repository.RepositoryError(
            f"model {model.id}: {len(together)} engine(s) on one GPU reserve "
            f"{' + '.join(f'{f:g}' for f in together)} of its memory for KV cache (more than "
            f"{GPU_MEMORY_SHARE}); lower kv_cache_free_gpu_mem_fraction in "
            "build_engines/trtllm.yaml (e.g. 0.85 / max_models_per_replica) and run "
            "`make engines`, or lower max_models_per_replica"
        )


def autoscaling(model: ModelConfig) -> AutoscalingConfig:
    """The model's autoscaling_config; ``target_ongoing_requests`` defaults to the
    engine's batch size: a replica scales out once its batch is full and more waits."""
    given = model.deployment.autoscaling_config
    # Set in the config, not Serve's default of 2 (which it always holds).
    if given is not None and "target_ongoing_requests" in given.model_fields_set:
        return given
    target = float(_batch_size(model))
    if given is None:
        return AutoscalingConfig(min_replicas=1, max_replicas=1, target_ongoing_requests=target)
    return given.model_copy(update={"target_ongoing_requests": target})


def max_ongoing_requests(model: ModelConfig) -> int:
    """A replica's ``max_ongoing_requests``. Unset: twice its autoscaling target (the
    engine's batch size by default; with ``num_replicas``, the batch size): a full
    batch running and as much again waiting in the engine's queue, so that a replica
    fills its batch and, past its target, the autoscaler adds replicas while the
    replicas still take requests. Given below the target it is refused: a replica
    would never reach the target, and requests would queue and be shed with 503
    before any scale-out."""
    given = model.deployment.max_ongoing_requests
    scaling = model.deployment.num_replicas is None
    target = autoscaling(model).target_ongoing_requests if scaling else _batch_size(model)
    if given is None:
        return max(2 * math.ceil(target), 1)
    if scaling and given < target:
        raise ValueError(
            f"model {model.id}: max_ongoing_requests {given} is below its autoscaling "
            f"target of {target:g} ongoing requests per replica (target_ongoing_requests; "
            "unset, the engine's batch size): a replica would never fill its batch, and "
            "requests would be shed with 503 before it scales out. Raise "
            f"max_ongoing_requests to at least {target:g} (unset: twice the target, "
            f"{2 * math.ceil(target)}) or lower autoscaling_config.target_ongoing_requests"
        )
    return given


# vLLM's running batch where a config sets neither its max_num_seqs nor the replica's
# max_ongoing_requests.
VLLM_DEFAULT_BATCH = 32


def _batch_size(model: ModelConfig) -> int:
    if model.task != "generate":
        return 8  # an embeddings request is one short forward: a small target suffices
    if model.engine == "vllm":  # vLLM's running batch; unset: a full replica
        engine_kwargs = model.vllm.llm_config.get("engine_kwargs", {})
        full = model.deployment.max_ongoing_requests or VLLM_DEFAULT_BATCH
        return engine_kwargs.get("max_num_seqs", full)
    return repository.engine_batch_size(model.triton.repository_path(), model.engine_model())


def fair_seats(config: AppConfig) -> dict[str, int]:
    """Each generate model's seats in one ingress replica (serve/api/common/fairness.py): what
    its replicas run at their autoscaling target (the engine's batch by default; with
    ``num_replicas``, the batch; never past ``max_ongoing_requests``) and their most
    replicas, shared among the ingress replicas. Past them requests wait in
    the ingress, in fair order, rather than in Serve's and the engines' queues, first
    come first served. A model still scaling out gets its most replicas' seats: the
    requests the replicas running cannot take queue in Serve, where the autoscaler sees
    them. Empty: fair shares off."""
    if not config.fair_shares:
        return {}
    seats = {}
    for model in config.models:
        if model.task != "generate":
            continue
        deployment = model.deployment
        if deployment.num_replicas is not None:
            per_replica, replicas = _batch_size(model), deployment.num_replicas
        else:
            scaling = autoscaling(model)
            per_replica, replicas = scaling.target_ongoing_requests, scaling.max_replicas
        per_replica = min(per_replica, max_ongoing_requests(model))  # what a replica takes
        seats[model.id] = max(1, math.ceil(per_replica * replicas / config.ingress.num_replicas))
    return seats


def ingress_options(config: AppConfig) -> dict[str, Any]:
    options = config.ingress.model_dump(exclude={"ray_actor_options"}, exclude_none=True)
    options["ray_actor_options"] = config.ingress.ray_actor_options.to_ray()
    # The ingress holds a stream as long as the replica behind it: drain as long.
    options["graceful_shutdown_timeout_s"] = max(m.drain_timeout_s() for m in config.models)
    return {"name": "OpenAIIngress", **options}
