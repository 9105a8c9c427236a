"""The application's configuration: Serve YAML ``args``, validated once with pydantic.

One ``AppConfig`` describes the whole application: the models it serves (each its
own Triton model repository and its own Serve deployment of Triton replicas, with
its own resources, autoscaling and limits), the HTTP front door's limits, its
API keys and where stored responses live. Errors name the bad field (pydantic's own
messages). Config objects do no I/O; :mod:`serve.app` reads the repositories they name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from ray.serve.config import AutoscalingConfig

from tritonllm import contract

ROOT = Path(__file__).resolve().parent.parent

# Model ids reach logs, metrics labels, deployment names and (for multiplexed
# variants) Triton model names: no path separators, no spaces.
ModelId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
# A variant's id is also part of its Triton model names (``ensemble-<id>``).
VariantId = Annotated[str, StringConstraints(pattern=contract.VARIANT_NAME)]
# A LoRA adapter's name is its directory's name under dynamic_lora_loading_path and the
# part after the colon of ``<base id>:<adapter>``: no path separators, no colon.
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
AdapterName = Annotated[str, StringConstraints(pattern=ADAPTER_NAME)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TritonConfig(_Strict):
    model_repository: Path = Field(
        Path("model_repository"),
        description="the built model repository (make engines); relative to the project root",
    )
    mode: Literal["auto", "in_process", "sidecar"] = Field(
        "auto",
        description="auto: in-process where the tritonserver API loads, else sidecar; "
        "in_process or sidecar force one (serve/engines/triton/select.py)",
    )
    start_timeout_s: float = Field(300.0, gt=0, description="how long Triton may take to load")
    pipeline: Literal["replica", "ensemble"] = Field(
        "replica",
        description="replica: the replica tokenizes and detokenizes with the repository's "
        "own tokenizer and settings and sends the engine step its tensors (one Triton hop "
        "per streamed response); ensemble: through Triton's ensemble "
        "(serve/engines/triton/steps.py)",
    )

    def repository_path(self) -> Path:
        return _from_root(self.model_repository)


class VLLMConfig(_Strict):
    """A model served by vLLM through Ray Serve LLM's own ``LLMServer`` (docs/vllm.md).

    ``llm_config`` is Ray Serve LLM's ``LLMConfig`` as its users write it (engine_kwargs,
    accelerator_type or accelerator_config, lora_config, runtime_env, ...), validated by
    Ray Serve LLM itself when the application is built; its ``model_loading_config``
    comes from the model's ``id`` and ``checkpoint``, its ``deployment_config`` from the
    model's ``deployment``, as for a Triton model.
    """

    checkpoint: Path = Field(
        description="the Hugging Face checkpoint directory vLLM loads (weights, config, "
        "tokenizer, chat template); relative to the project root"
    )
    python: Path = Field(
        Path(".venv-vllm/bin/python"),
        description="the interpreter of the vLLM environment (make vllm-env): the replica "
        "runs in it (runtime_env py_executable); same Python and Ray versions as the "
        "project's; relative to the project root",
    )
    llm_config: dict[str, Any] = Field(
        default_factory=dict, description="Ray Serve LLM's LLMConfig fields, passed through"
    )

    @model_validator(mode="after")
    def _ours_not_passed_through(self) -> VLLMConfig:
        taken = {"model_loading_config", "deployment_config"} & set(self.llm_config)
        if taken:
            raise ValueError(
                f"llm_config.{sorted(taken)[0]} comes from the model's id, checkpoint and "
                "deployment fields: set those instead"
            )
        return self

    def checkpoint_path(self) -> Path:
        return _from_root(self.checkpoint)

    def python_path(self) -> Path:
        # Not resolved: a virtualenv's python is a symlink, and resolving it would
        # leave the virtualenv.
        return _from_root(self.python)


def _from_root(path: Path) -> Path:
    path = path.expanduser()
    return path if path.is_absolute() else ROOT / path


class LoraConfig(_Strict):
    """LoRA adapters of the model, loaded at runtime (docs/lora.md). The first two
    fields are Ray Serve LLM's ``LoraConfig``'s, with the same meaning."""

    dynamic_lora_loading_path: str = Field(
        description="the directory whose subdirectories are the adapters (PEFT's "
        "adapter_config.json and adapter_model.safetensors): a local path (relative to "
        "the project root) or any fsspec URL the replicas can read (s3://, gs://, ...)"
    )
    max_num_adapters_per_replica: int = Field(
        16, ge=1, description="adapters one replica keeps loaded (least recently used leaves)"
    )
    max_lora_rank: int = Field(
        64, ge=1, le=256, description="adapters of a larger rank are refused (a 400)"
    )
    aliases: dict[ModelId, AdapterName] = Field(
        default_factory=dict,
        description="extra `model` names clients may send: alias -> adapter directory name",
    )

    def adapters_url(self) -> str:
        """The directory as fsspec opens it (a relative local path from the project root)."""
        path = self.dynamic_lora_loading_path.rstrip("/")
        return path if "://" in path else str(_from_root(Path(path)))


class RayActorOptions(_Strict):
    """The resources of one replica (Ray's ``ray_actor_options``)."""

    num_cpus: float = Field(1, ge=0, description="CPUs Ray reserves for the replica")
    num_gpus: float = Field(
        0, ge=0, description="GPUs per replica: 1 on GPU boxes (a replica never shares one)"
    )
    memory: int | None = Field(None, gt=0, description="bytes of memory Ray reserves")
    resources: dict[str, float] = Field(default_factory=dict, description="custom resources")
    accelerator_type: str | None = Field(None, description="e.g. H100, A10G")
    runtime_env: dict[str, Any] = Field(default_factory=dict, description="Ray runtime_env")

    def to_ray(self) -> dict[str, Any]:
        """As ``ray_actor_options``: unset and empty entries left out."""
        return {k: v for k, v in self.model_dump(exclude_none=True).items() if v != {}}


class DeploymentOptions(_Strict):
    """Serve's deployment options, with defaults chosen for LLM serving.

    Serve's own defaults (one replica, no autoscaling, ``max_ongoing_requests: 5``,
    a 20 s graceful shutdown) would neither scale nor let a long answer finish
    during a rolling update; every value here is set on purpose.
    """

    num_replicas: int | None = Field(
        None, ge=1, description="a fixed replica count instead of autoscaling_config"
    )
    autoscaling_config: AutoscalingConfig | None = Field(
        None,
        description="Serve's autoscaling_config; when unset, 1 to 1 replicas with "
        "target_ongoing_requests = the engine's batch size",
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="requests a replica holds at once (running + in its engine queue); "
        "unset: twice the autoscaling target (the engine's batch size by default): a full "
        "batch running and one more waiting; below the target it is refused",
    )
    max_queued_requests: int = Field(
        64, ge=-1, description="requests waiting for a replica before a 503 (-1: no bound)"
    )
    graceful_shutdown_timeout_s: float | None = Field(
        None,
        gt=0,
        description="how long a stopping replica drains; unset: the longest answer the "
        "max_tokens cap allows (max_tokens_cap x slowest_token_s + 30 s)",
    )
    graceful_shutdown_wait_loop_s: float = Field(1.0, gt=0)
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    max_constructor_retry_count: int = Field(
        3, ge=1, description="failed replica starts before the deployment is DEPLOY_FAILED"
    )
    ray_actor_options: RayActorOptions = Field(default_factory=RayActorOptions)
    max_replicas_per_node: int | None = Field(
        None,
        ge=1,
        description="at most this many replicas on one Ray node (1: a node's loss takes "
        "one replica); unset: no limit",
    )
    access_log: bool | None = Field(
        None,
        description="Serve's access log line for each call a Triton model's replicas "
        "serve; unset: on where they answer HTTP (layout: direct), off behind the "
        "ingress, whose own line has the request's id, status and time",
    )

    @model_validator(mode="after")
    def _one_scaling_mode(self) -> DeploymentOptions:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("set num_replicas or autoscaling_config, not both")
        scaling = self.autoscaling_config
        # As the config sets it (Serve's model holds its default of 2 otherwise).
        given = scaling is not None and "target_ongoing_requests" in scaling.model_fields_set
        target = scaling.target_ongoing_requests if given else None
        if target and self.max_ongoing_requests and self.max_ongoing_requests < target:
            raise ValueError(
                f"max_ongoing_requests {self.max_ongoing_requests} is below "
                f"autoscaling_config.target_ongoing_requests {target:g}: a replica would "
                "never reach its target, and requests would be shed with 503 before it "
                "scales out; raise max_ongoing_requests (unset: twice the target) or lower "
                "the target"
            )
        return self


class ModelConfig(_Strict):
    """One model the application serves, on its own Triton replicas."""

    id: ModelId = Field(description="the name clients send as `model`")
    task: Literal["generate", "embed"] = Field(
        "generate", description="generate: an LLM ensemble; embed: an embeddings model"
    )
    engine: Literal["triton", "vllm"] = Field(
        "triton",
        description="triton: Triton replicas over `triton.model_repository`; vllm: Ray "
        "Serve LLM's LLMServer over `vllm.checkpoint` (the same ingress routes to both)",
    )
    triton: TritonConfig = Field(default_factory=TritonConfig)
    vllm: VLLMConfig | None = Field(None, description="required for engine: vllm")
    triton_model: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="the Triton model requests go to; default: ensemble (generate), "
        "embeddings (embed)",
    )
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)
    max_tokens_cap: int = Field(512, gt=0, description="largest max_tokens a request may ask")
    default_max_tokens: int = Field(64, gt=0, description="max_tokens when a request sets none")
    slowest_token_s: float = Field(
        0.2,
        gt=0,
        description="an upper bound of one decode step under full load; sizes the drain time",
    )
    stream_interval_ms: float = Field(
        0,
        ge=0,
        le=1000,
        description="throughput first: a stream's chunks leave a replica at most this often, "
        "each holding every token generated meanwhile (the first never waits); 0: each "
        "chunk leaves when ready, tokens merging only while a hop is behind",
    )
    stream_chunks_per_s: float = Field(
        1000,
        ge=0,
        description="under load, the chunks a second one replica's streams share: each "
        "stream's chunks leave at most every (live streams / this) seconds, each holding "
        "every token made meanwhile; a stream whose tokens come slower sends each at once, "
        "and the first never waits; 0: no shared budget",
    )
    variants: list[VariantId] = Field(
        default_factory=list,
        description="model multiplexing: variants (fine-tuned checkpoints of one base) "
        "served by one pool of replicas; clients send a variant's id as `model`; each is "
        "`ensemble-<variant>` in the repository (python -m build_engines --variant NAME=DIR)",
    )
    max_models_per_replica: int = Field(
        2, ge=1, description="variants one replica keeps loaded (least recently used leaves)"
    )
    lora: LoraConfig | None = Field(
        None,
        description="LoRA adapters on this base model, found at runtime in "
        "lora.dynamic_lora_loading_path; clients send `<id>:<adapter>` (docs/lora.md)",
    )
    routing: Literal["default", "prefix_aware", "kv_aware"] = Field(
        "default",
        description="how Serve picks a replica: default (power of two choices on load), "
        "prefix_aware (Ray's PrefixCacheAffinityRouter: the replica that served the "
        "longest prefix of the prompt, while loads stay within one engine batch of each "
        "other; in a pool of variants, among the replicas holding the variant) or "
        "kv_aware (the replica whose engine holds the longest prefix, from the engines' "
        "own KV cache events through Dynamo's indexer, loads as prefix_aware; no "
        "variants; an engine publishing no events, as prefix_aware; "
        "docs/prefix-caching.md)",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None,
        description="how the model writes tool calls (vLLM's parser names): hermes "
        "(<tool_call> JSON: Hermes, Qwen 2.5/3, the default model) or llama3_json (Llama "
        "3.1+); unset, requests with tools are refused (docs/structured-outputs.md)",
    )
    max_migrations: int = Field(
        2,
        ge=0,
        le=10,
        description="how many times a generation whose replica is lost (its actor, its "
        "Triton or its node) is resumed on another replica where it was cut: the client's "
        "stream goes on; past this, an error (docs/operations.md#replica-loss)",
    )
    optional: bool = Field(
        False,
        description="serve this model only where its repository is built: an unbuilt one "
        "is left out of the app with a warning, instead of failing the whole deployment",
    )

    @model_validator(mode="after")
    def _engine_settings(self) -> ModelConfig:
        if self.engine == "vllm":
            if self.vllm is None:
                raise ValueError("engine: vllm needs a vllm section (at least its checkpoint)")
            if self.task != "generate" or self.variants:
                raise ValueError(
                    "engine: vllm serves task: generate without variants (LoRA adapters: "
                    "a lora: section, Ray Serve LLM's lora_config)"
                )
            if self.deployment.access_log is not None:
                raise ValueError(
                    "deployment.access_log is a Triton model's setting: Ray Serve LLM's "
                    "replicas log an access line for each call"
                )
        elif self.vllm is not None:
            raise ValueError("a vllm section needs engine: vllm")
        return self

    @model_validator(mode="after")
    def _variants_generate(self) -> ModelConfig:
        if self.variants and self.task != "generate":
            raise ValueError("variants are served for task: generate only")
        if len(set(self.variants)) != len(self.variants):
            raise ValueError("variant ids must be unique")
        if self.routing != "default" and self.task != "generate":
            raise ValueError(f"routing: {self.routing} routes prompts: task generate only")
        if self.routing == "kv_aware" and (self.variants or self.engine != "triton"):
            raise ValueError(
                "routing: kv_aware follows one Triton engine per replica (its KV cache "
                "events); a pool of variants or engine: vllm routes with prefix_aware"
            )
        return self

    @model_validator(mode="after")
    def _lora_on_one_base(self) -> ModelConfig:
        if self.lora is None:
            return self
        if self.task != "generate":
            raise ValueError("lora serves adapters of a generate model (task: generate)")
        if self.variants:
            # An adapter is a delta of one base checkpoint; in a pool each variant is
            # another checkpoint, and both would share the replica's one multiplexer.
            raise ValueError("lora and variants do not mix: an adapter needs one base model")
        return self

    def adapter_id(self, adapter: str) -> str:
        """The id an adapter of this model is listed and answered as, and its Serve
        multiplexed model id (as Ray Serve LLM's)."""
        return f"{self.id}:{adapter}"

    def entry_model(self, variant: str | None = None) -> str:
        """The Triton model a request goes to (a variant's own ensemble in a pool)."""
        if variant is not None:
            return contract.variant_ensemble(variant)
        return self.triton_model or ("ensemble" if self.task == "generate" else "embeddings")

    def entry_models(self) -> list[str]:
        """Every Triton model requests may go to (one per variant in a pool)."""
        return [self.entry_model(v) for v in self.variants] or [self.entry_model()]

    def engine_model(self) -> str:
        """The engine step whose batch size sizes the replica (a pool's first variant's)."""
        return contract.variant_engine(self.variants[0]) if self.variants else contract.TENSORRT_LLM

    def startup_models(self) -> tuple[str, ...]:
        """What Triton loads at start: everything, or for a pool of variants only the
        shared steps (each variant's ensemble loads on its first request)."""
        return (contract.PREPROCESSING, contract.POSTPROCESSING) if self.variants else ("*",)

    def served_ids(self) -> list[str]:
        """The ids clients send for this model (its adapters are found at runtime)."""
        return list(self.variants) or [self.id]

    def deployment_name(self) -> str:
        return f"{'vLLM' if self.engine == 'vllm' else 'Triton'}-{self.id}"

    def drain_timeout_s(self) -> float:
        explicit = self.deployment.graceful_shutdown_timeout_s
        return explicit or self.max_tokens_cap * self.slowest_token_s + 30.0


class APIKeys(_Strict):
    """Where the API keys come from; with none found, the API is open (loopback use)."""

    env: str | None = Field(
        "TRITONLLM_API_KEYS", description="environment variable with comma-separated keys"
    )
    file: Path | None = Field(None, description="a file with one key per line")
    tenants_file: Path | None = Field(
        None,
        description="a YAML file of named tenants: each with its keys (plain or "
        "sha256:<hex>) and the models it may use (docs/operations.md)",
    )


class _InRedis(_Strict):
    """A store that may be a Redis (``store: redis``): exactly one of its URL and the
    environment variable that holds it."""

    redis_url: str | None = Field(None, description="redis: the URL, e.g. redis://host:6379/0")
    redis_url_env: str | None = Field(
        None,
        description="redis: an environment variable of the ingress holding the URL "
        "(a password stays out of the Serve config)",
    )

    @model_validator(mode="after")
    def _one_redis_url(self):
        if self.store == "redis" and (self.redis_url is None) == (self.redis_url_env is None):
            raise ValueError("store: redis needs exactly one of redis_url and redis_url_env")
        return self


class ResponsesConfig(_InRedis):
    """Where the Responses API keeps the responses clients ask it to store (``store:
    true``) for ``previous_response_id`` and ``GET`` / ``DELETE /v1/responses/{id}``."""

    store: Literal["memory", "redis", "none"] = Field(
        "memory",
        description="memory: one replica of the app holds them (lost when it restarts); "
        "redis: a Redis keeps them; none: no response is kept",
    )
    ttl_s: float = Field(
        30 * 24 * 3600.0, gt=0, description="how long a response is kept after it is stored"
    )
    max_memory_mb: float = Field(
        256, gt=0, description="memory store: the responses' JSON, least recently used out first"
    )
    key_prefix: str = Field(
        "tritonllm:responses:",
        description="redis: each key's prefix (apart from Ray's keys in a shared Redis)",
    )

    def max_memory_bytes(self) -> int:
        return int(self.max_memory_mb * (1 << 20))


class RateLimitsConfig(_InRedis):
    """Where the tenants' rate limits (``requests_per_minute`` in the tenants file)
    keep their counts."""

    store: Literal["memory", "redis"] = Field(
        "memory",
        description="memory: each ingress replica counts alone (holds for one ingress "
        "replica); redis: one count per tenant across every replica",
    )
    key_prefix: str = Field("tritonllm:limits:", description="redis: each key's prefix")
    on_store_error: Literal["open", "closed"] = Field(
        "open",
        description="redis unreachable: open lets requests in unlimited, closed refuses "
        "them with a 503",
    )


class IngressOptions(_Strict):
    """The HTTP front door's Serve options: light, async, many requests at once."""

    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(
        1024, ge=1, description="concurrent HTTP requests per ingress replica"
    )
    ray_actor_options: RayActorOptions = Field(default_factory=lambda: RayActorOptions(num_cpus=0))
    max_replicas_per_node: int | None = Field(
        None,
        ge=1,
        description="at most this many ingress replicas on one Ray node (1, with two or "
        "more replicas: a node's loss leaves one serving); unset: no limit",
    )


class AppConfig(_Strict):
    models: list[ModelConfig] = Field(
        default_factory=lambda: [ModelConfig(id="tritonllm-default")],
        min_length=1,
        description="the models served; the first generate model also answers /generate",
    )
    max_body_bytes: int = Field(
        1 << 20, gt=0, description="larger request bodies get a 413 before they are read"
    )
    max_prompt_chars: int = Field(
        1 << 17, gt=0, description="a prompt (or all messages together) past this is a 400"
    )
    max_messages: int = Field(256, gt=0, description="chat messages a request may hold")
    api_keys: APIKeys = Field(default_factory=APIKeys)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    rate_limits: RateLimitsConfig = Field(default_factory=RateLimitsConfig)
    ingress: IngressOptions = Field(default_factory=IngressOptions)
    fair_shares: bool = Field(
        True,
        description="layout ingress: while a model's replicas are at capacity, the "
        "ingress admits its requests by priority, then by tenant in proportion to the "
        "tenants' weights (deficit round robin over tokens), so that one tenant's flood "
        "waits in its own queue; false: first come, first served",
    )
    layout: Literal["ingress", "direct"] = Field(
        "ingress",
        description="ingress: an OpenAIIngress deployment routes each request to its "
        "model's replicas, and a stream whose replica is lost resumes on another; direct: "
        "one model's Triton replicas serve the API themselves behind HAProxy (one process "
        "crossing fewer per chunk; a lost replica ends its streams). docs/architecture.md",
    )

    @model_validator(mode="after")
    def _direct_serves_one_model(self) -> AppConfig:
        """``direct`` has no ingress to route by model, variant, adapter or prefix."""
        if self.layout != "direct":
            return self
        model = self.models[0]
        refusals = [
            (len(self.models) > 1, f"{len(self.models)} models (it serves one)"),
            (model.engine != "triton", f"engine: {model.engine}"),
            (bool(model.variants), "variants"),
            (model.lora is not None, "lora"),
            (model.routing != "default", f"routing: {model.routing}"),
        ]
        found = [why for refused, why in refusals if refused]
        if found:
            raise ValueError(
                f"layout: direct serves one Triton model without routing; this app has "
                f"{', '.join(found)}: use layout: ingress"
            )
        return self

    @model_validator(mode="after")
    def _unique_ids(self) -> AppConfig:
        ids = [m.id for m in self.models] + [v for m in self.models for v in m.variants]
        ids += [a for m in self.models if m.lora for a in m.lora.aliases]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"model ids must be unique: {', '.join(duplicates)}")
        if not any(m.task == "generate" for m in self.models):
            raise ValueError("at least one model must have task: generate")
        return self

    def model(self, model_id: str) -> ModelConfig | None:
        return next((m for m in self.models if m.id == model_id), None)

    def resolve(self, model_id: str) -> tuple[ModelConfig, str | None] | None:
        """The model a client's ``model`` names and, for a pool, the variant or, for a
        model with ``lora``, the adapter (``<id>:<adapter>`` or an alias; whether the
        adapter exists is for the caller to check: adapters come and go at runtime)."""
        for model in self.models:
            if model_id in model.variants:
                return model, model_id
            if model.lora and model_id in model.lora.aliases:
                return model, model.lora.aliases[model_id]
        model = self.model(model_id)
        if model is not None:
            return model, None
        base, _, adapter = model_id.rpartition(":")
        model = self.model(base)
        if model is not None and model.lora and re.fullmatch(ADAPTER_NAME, adapter):
            return model, adapter
        return None

    def served_ids(self) -> list[str]:
        return [i for m in self.models for i in m.served_ids()]

    @property
    def default_target(self) -> tuple[ModelConfig, str | None]:
        """What /generate runs: the first generate model (a pool's first variant)."""
        model = next(m for m in self.models if m.task == "generate")
        return model, (model.variants[0] if model.variants else None)
