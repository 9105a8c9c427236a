"""The Triton replica: one Triton server per Serve replica, streaming chunks to the ingress."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np
from ray import serve

from serve.adapters import Adapter, read_adapter
from serve.config import ModelConfig
from serve.engines.triton import repository
from serve.engines.triton.host import TritonHost
from serve.engines.triton.kv_events import KvEventEndpoints
from serve.engines.triton.requests import AdapterInputs, EnsembleRoute, Route
from serve.engines.triton.select import choose_host
from serve.engines.triton.steps import ReplicaSteps, StepsUnsupported, read_steps
from serve.generation import (
    GenerateParams,
    GenerationChunk,
    GenerationError,
    StreamPacing,
    coalesce,
)
from serve.metrics import MetricsPublisher, replica_labels
from tritonllm import contract, lora

log = logging.getLogger("ray.serve")

# How often a replica looks whether its Triton child process is alive (a waitpid).
TRITON_WATCH_S = 0.2

# The field Serve's access lines carry (the `extra` of Serve's replica).
ACCESS_LINE = "serve_access_log"


def logs_access(model: ModelConfig, answers_http: bool) -> bool:
    """Whether the replica writes Serve's access line for each call (deployment.access_log):
    by default where it answers HTTP, not behind the ingress, whose own line has the
    request's id, status and time: a line per call costs the replica's event loop its
    record's formatting and write for every request."""
    setting = model.deployment.access_log
    return answers_http if setting is None else setting


def not_an_access_line(record: logging.LogRecord) -> bool:
    """A filter of Serve's logger: it drops a record before any handler formats or writes
    it. Serve's own switch (``logging_config.enable_access_log: false``) would take the
    request id off the replica's other lines too (Ray 2.60 adds its request-context
    filter to the file handler only where the access log is on), and would replace the
    application's ``logging_config`` for the deployment."""
    return not getattr(record, ACCESS_LINE, False)


class TritonReplica:
    """Plain class; ``serve.deployment`` wraps it in :func:`serve.app.build_app`.

    Serve counts the replica ready when ``__init__`` returns, which is after Triton
    reports every model it loads at start ready; a repository that fails to load
    raises here with Triton's own message, which Serve shows in the deployment's
    status. On shutdown Serve first drains the replica (up to
    ``graceful_shutdown_timeout_s``), then ``__del__`` stops Triton.

    A pool of variants (``ModelConfig.variants``) starts with the shared steps only;
    a variant's ensemble loads on its first request, through Serve's model
    multiplexing, which also unloads the least recently used one past
    ``max_models_per_replica`` and routes a variant's requests to the replicas
    holding it.

    A model with ``lora`` multiplexes its LoRA adapters the same way: an adapter is
    read from the adapter directory and checked against the base model on its first
    request to the replica, which keeps ``max_num_adapters_per_replica`` of them; the
    engine gets its weights once and the task id afterwards (docs/lora.md).
    """

    async def __init__(
        self,
        model: ModelConfig,
        host: TritonHost | None = None,
        metrics_collector=None,
        answers_http: bool = False,
    ):
        """``answers_http``: this replica is the app's front door (layout: direct)."""
        self.model = model
        if not logs_access(model, answers_http):
            log.addFilter(not_an_access_line)  # Serve's own logger, where it writes them
        self.pacing = StreamPacing(model.stream_interval_ms, model.stream_chunks_per_s)
        engine_step = self._engine_step_alone()
        # The model whose readiness is this replica's (check_health, /health).
        self.serving_model = engine_step or model.entry_model()
        if model.variants:  # a pool has no fixed model: its shared preprocessing stands in
            self.serving_model = contract.PREPROCESSING
        startup = (engine_step,) if engine_step else model.startup_models()
        self.host = host or choose_host(model.triton, startup)
        self._routes: dict[str, Route] = {}  # ensemble -> how its requests go (_route)
        # routing: kv_aware: where its engine publishes (set before Triton starts).
        self._kv_events = KvEventEndpoints.open(model) if model.routing == "kv_aware" else None
        self._adapter_task_ids: dict[str, int] = {}  # the adapters loaded, by name
        self.tokenizer = await self._start_triton_and_tokenizer()
        self._watch = asyncio.create_task(self._exit_with_triton())
        self._metrics = None  # Triton's metrics text, to the app's collector (GET /metrics)
        if metrics_collector is not None:
            self._metrics = MetricsPublisher(metrics_collector, self.host.metrics, replica_labels())
            self._metrics.start()
        if model.task == "embed":  # texts per Triton request (a longer list is split)
            config = repository.read_config(model.triton.repository_path(), model.entry_model())
            self._embed_batch = max(config.max_batch_size, 1)
        self._multiplex(model)

    async def _start_triton_and_tokenizer(self):
        """Triton started; the tokenizer, where this replica tokenizes itself (None where
        not). Each takes seconds (the tokenizer's load, transformers' import): side by
        side, off the event loop."""
        model = self.model
        loads = [asyncio.to_thread(self.host.start)]
        if model.task == "generate" and model.triton.pipeline == "replica":
            # The preprocessing's: shared by every ensemble (a pool's variants) and, in
            # layout: direct, the API.
            repository_dir = model.triton.repository_path()
            loads.append(asyncio.to_thread(repository.load_tokenizer, repository_dir))
        loaded = await asyncio.gather(*loads, return_exceptions=True)
        for result in loaded:  # Triton's own reason first, where both failed
            if isinstance(result, BaseException):
                raise result
        return loaded[1] if len(loaded) > 1 else None

    def _multiplex(self, model: ModelConfig) -> None:
        """Serve's multiplexing of a pool's variants and of LoRA adapters, where the
        model has them."""
        if model.variants:

            async def load(variant: str) -> LoadedVariant:
                return await self._load_variant(variant)

            # Built here, not as a decorated method: K comes from the config (Serve
            # detects multiplexing wired up at init, `_callable_uses_multiplexing`).
            self._variant = serve.multiplexed(
                max_num_models_per_replica=model.max_models_per_replica
            )(load)
        if model.lora:
            checkpoint = repository.tokenizer_dir(model.triton.repository_path())
            config = json.loads((checkpoint / "config.json").read_text())
            self._module_shapes = lora.llama_module_shapes(config)

            async def load_adapter(adapter_id: str) -> LoadedAdapter:
                return await self._load_adapter(adapter_id.rpartition(":")[2])

            self._adapter = serve.multiplexed(
                max_num_models_per_replica=model.lora.max_num_adapters_per_replica
            )(load_adapter)

    def record_routing_stats(self) -> dict:
        """Serve's routing stats: where the router subscribes to this replica's KV cache
        events (routing: kv_aware); none otherwise."""
        if self._kv_events is None:
            return {}
        return self._kv_events.routing_stats(self._adapter_task_ids)

    def _engine_step_alone(self) -> str | None:
        """The engine step, where it is all this replica's Triton needs to load: the
        replica tokenizes and detokenizes itself (``triton.pipeline: replica``) along
        one ensemble of the chain it runs. The ensemble and its two Python steps would
        idle there, two stubs that each import transformers and load the tokenizer (a
        few seconds of CPU at every start, and their memory). None: Triton loads what
        :meth:`ModelConfig.startup_models` says; an unreadable repository among them,
        for Triton to name what is wrong with it."""
        model = self.model
        if model.task != "generate" or model.triton.pipeline != "replica" or model.variants:
            return None
        try:
            return read_steps(model.triton.repository_path(), model.entry_model()).engine
        except (StepsUnsupported, repository.RepositoryError):
            return None

    async def _exit_with_triton(self) -> None:
        """A replica whose Triton died cannot serve again: it exits at once, so that
        Serve's routers drop it and its controller starts another, and the generations
        it was serving resume on the other replicas (serve/migration.py). Left to its
        health check, it would take three failed checks, and the routers would go on
        sending it requests (the least loaded replica, now) that fail at once."""
        while not self.host.exited():
            await asyncio.sleep(TRITON_WATCH_S)
        log.error("Triton exited: the replica exits for Serve to replace it")
        try:
            self.host.stop()  # removes the shared memory the dead Triton left
        except Exception:  # exit all the same
            log.exception("could not clean up after Triton")
        logging.shutdown()
        os._exit(1)

    def _route(self, ensemble: str) -> Route:
        """How a request for ``ensemble`` goes to Triton (``triton.pipeline``): to its
        engine step with the tokenizing and detokenizing done here, or through it."""
        if ensemble not in self._routes:
            self._routes[ensemble] = EnsembleRoute(ensemble)
            if self.model.triton.pipeline == "replica":
                try:
                    self._routes[ensemble] = ReplicaSteps.load(
                        self.model.triton.repository_path(), ensemble, self.tokenizer
                    )
                except StepsUnsupported as error:
                    log.warning("%s: requests go through the ensemble: %s", ensemble, error)
        return self._routes[ensemble]

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerationChunk]:
        ensemble = self.model.entry_model()
        if params.variant is not None:
            ensemble = (await self._variant(params.variant)).ensemble
        route = self._route(ensemble)
        if params.adapter is not None:
            chunks = self._generate_with_adapter(params, route)
        else:
            chunks = self.host.generate(params, route)
        # What Triton sends while this replica (or Ray's hop to the ingress) is busy
        # leaves as one chunk: every yield is one Ray object or SSE event, whatever it
        # holds; under load the replica's streams share a chunk rate (StreamPacing).
        async for chunk in coalesce(chunks, self.pacing):
            yield chunk

    async def _generate_with_adapter(
        self, params: GenerateParams, route: Route
    ) -> AsyncIterator[GenerationChunk]:
        """The adapter's task id, with its weights until the engine has taken them once;
        an engine that no longer holds them (its cache evicted them) answers a cache
        miss before any token, and the request goes again with the weights."""
        # Keyed by the multiplexed model id the ingress routed by: <base>:<adapter>.
        loaded = await self._adapter(self.model.adapter_id(params.adapter))
        with_weights, started = not loaded.in_engine, False
        try:
            async for chunk in self._adapter_attempt(loaded, params, with_weights, route):
                started = True
                yield chunk
            return
        except GenerationError as error:
            miss = contract.LORA_CACHE_MISS.search(str(error))
            if started or with_weights or not miss:
                raise
        log.info("engine no longer holds adapter %s: resending its weights", params.adapter)
        resend = dataclasses.replace(params, request_id=f"{params.request_id}.w")
        async for chunk in self._adapter_attempt(loaded, resend, True, route):
            yield chunk

    async def _adapter_attempt(
        self, loaded: LoadedAdapter, params: GenerateParams, with_weights: bool, route: Route
    ) -> AsyncIterator[GenerationChunk]:
        # aclosing: a caller that goes away stops the engine's sequence at once.
        async with aclosing(
            self.host.generate(params, route, loaded.inputs(with_weights))
        ) as chunks:
            async for chunk in chunks:
                loaded.in_engine = True  # the engine took the request: it holds the adapter
                yield chunk

    async def _load_adapter(self, name: str) -> LoadedAdapter:
        """Read, pack and check adapter ``name``: an adapter that cannot be served is
        the client's 400, and the replica goes on serving."""
        shapes, num_layers = self._module_shapes
        settings = self.model.lora

        def read() -> Adapter:
            adapter = read_adapter(settings.adapters_url(), name)
            lora.check_fits(adapter.tensors, shapes, num_layers, settings.max_lora_rank)
            return adapter

        try:
            adapter = await asyncio.to_thread(read)
        except FileNotFoundError:
            raise GenerationError(
                f"adapter {name!r} is not in the adapter directory", GenerationError.INVALID
            ) from None
        except lora.AdapterError as error:
            log.warning("adapter %s cannot be served: %s", name, error)
            raise GenerationError(f"adapter {name!r}: {error}", GenerationError.INVALID) from None
        self._adapter_task_ids[name] = adapter.task_id
        log.info(
            "loaded adapter %s (task id %d, rank %d, %d bytes)",
            name,
            adapter.task_id,
            adapter.tensors.max_rank,
            adapter.tensors.nbytes,
        )
        return LoadedAdapter(adapter)

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """One L2-normalised vector per text (in order) and the tokens read. The
        batches go to Triton at once: its dynamic batcher merges them with other
        callers' into full executes."""
        size = self._embed_batch
        batches = [texts[i : i + size] for i in range(0, len(texts), size)]
        outputs = await asyncio.gather(
            *(self.host.infer(self.model.entry_model(), _texts(batch)) for batch in batches)
        )
        vectors = np.concatenate([o[contract.EMBEDDINGS_VECTOR.name] for o in outputs]).astype(
            np.float32
        )
        return vectors, int(sum(o[contract.EMBEDDINGS_NUM_TOKENS.name].sum() for o in outputs))

    async def _load_variant(self, variant: str) -> LoadedVariant:
        if variant not in self.model.variants:
            raise GenerationError(f"unknown variant {variant!r}", GenerationError.INVALID)
        loaded = LoadedVariant(self.host, variant, asyncio.get_running_loop())
        log.info("loading variant %s into Triton (%s)", variant, loaded.ensemble)
        await self.host.load_model(loaded.ensemble)  # its engine step loads with it
        return loaded

    async def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; raising marks the replica
        unhealthy (three failures in a row and Serve replaces it)."""
        model = self.serving_model
        if not await self.host.is_ready(model):
            raise RuntimeError(f"Triton is not ready: the server exited or {model} is not loaded")

    def __del__(self):
        # Serve deletes a replica after draining it; Triton must not outlive it.
        metrics = getattr(self, "_metrics", None)
        if metrics is not None:
            metrics.stop()
        host = getattr(self, "host", None)
        if host is not None:
            try:
                host.stop()
            except Exception:
                log.exception("stopping Triton failed")


def _texts(batch: list[str]) -> dict[str, np.ndarray]:
    return {contract.EMBEDDINGS_TEXT.name: np.array([[t.encode()] for t in batch], dtype=object)}


class LoadedAdapter:
    """An adapter this replica holds (Serve's multiplexer keeps it, least recently used
    out first), and whether the engine has taken its weights."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter
        self.in_engine = False

    def inputs(self, with_weights: bool) -> AdapterInputs:
        tensors = self.adapter.tensors if with_weights else None
        return AdapterInputs(self.adapter.task_id, tensors)


class LoadedVariant:
    """A variant loaded in this replica's Triton.

    Serve's multiplexer calls ``__del__`` when it evicts the variant (from a worker
    thread), and the garbage collector may call it again later: the unload runs
    once, on the replica's event loop, where the host's client lives.
    """

    def __init__(self, host: TritonHost, variant: str, loop: asyncio.AbstractEventLoop):
        self.host = host
        self.variant = variant
        self.ensemble = contract.variant_ensemble(variant)
        self.engine = contract.variant_engine(variant)
        self._loop = loop
        self._unloaded = False

    async def unload(self) -> None:
        # The ensemble first (no new requests reach the engine), then its engine:
        # Triton does not unload an ensemble's steps unless asked, and the shared
        # pre/postprocessing must stay for the other variants.
        for name in (self.ensemble, self.engine):
            await self.host.unload_model(name)
        log.info("unloaded variant %s from Triton", self.variant)

    def __del__(self):
        if self._unloaded or self._loop.is_closed():
            return
        self._unloaded = True
        future = asyncio.run_coroutine_threadsafe(self.unload(), self._loop)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a worker thread (Serve's eviction): wait for the unload
            future.result(timeout=300)
