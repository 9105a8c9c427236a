"""What routing: kv_aware scores with (serve/routing/kv_aware.py has the why): Dynamo's
indexer following one model's replicas, the prompt's token ids, the router's figures.

Apart from the router's class because Serve sends that class to its controller
pickled by value, with the module globals its methods use: a Prometheus metric (its
lock) cannot travel, so the router imports this module where it runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram
from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.replica_wrapper import RunningReplica

from serve.engines.triton import repository
from serve.metrics import ROUTING_REGISTRY as REGISTRY
from tritonllm import tokenization

log = logging.getLogger("ray.serve")

# What a replica advertises in its routing stats (serve/engines/triton/kv_events.py).
KV_EVENT_METADATA = "kv_event_metadata"
_TENANT = "default"  # Dynamo's namespace within a model: one per deployment here
# A prompt of which no engine holds this share is a new prefix (Ray's prefix_aware
# router's match threshold): it goes where the caches were written least.
NEW_PREFIX_SHARE = 0.1
# How long a routed prompt counts as held by its replica before the engine's events say
# so: its wait in the queue and its prefill, on a loaded engine tens of seconds.
PLACED_TTL_S = 30.0

# In the ingress process, beside its request metrics (RequestMetrics.text adds them).
ROUTED = Counter(
    "tritonllm_kv_router_requests",
    "Requests routed by routing: kv_aware, by how: overlap (to the replicas holding "
    "the longest prefix of the prompt), placed (to the replica a prompt of the same "
    "prefix was just routed to, before its engine's events said so), no_overlap (none "
    "holds a tenth: a new prefix, to the replica sent the fewest), imbalanced (queues "
    "apart: by load), no_index (no indexer, no tokens or an adapter not named yet: by load)",
    ["model", "how"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "tritonllm_kv_router_prompt_tokens",
    "Prompt tokens scored by routing: kv_aware",
    ["model"],
    registry=REGISTRY,
)
OVERLAP_TOKENS = Counter(
    "tritonllm_kv_router_overlap_tokens",
    "Prompt tokens the chosen replica's engine held when routed (hit rate: this over "
    "tritonllm_kv_router_prompt_tokens)",
    ["model"],
    registry=REGISTRY,
)
OVERLAP_SHARE = Histogram(
    "tritonllm_kv_router_overlap_share",
    "Share of each routed prompt the chosen replica's engine held",
    ["model"],
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
    registry=REGISTRY,
)
WORKERS = Gauge(
    "tritonllm_kv_router_workers",
    "Replicas whose KV cache events this router's index follows",
    ["model"],
    registry=REGISTRY,
)
CHOICE_SECONDS = Histogram(
    "tritonllm_kv_router_choice_seconds",
    "Time the router took to score a request (tokenizing it, asking the index)",
    ["model"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
    registry=REGISTRY,
)


def worker_id(replica: ReplicaID) -> int:
    """The replica's id in the index (Ray Serve LLM's mapping)."""
    digest = hashlib.blake2b(replica.unique_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class KvIndex:
    """Dynamo's SelectionService for one model, following its replicas' events."""

    def __init__(self, model: str):
        self.model = model
        self._service = _selection_service(model)
        self._workers: dict[int, dict] = {}  # worker id -> the replica's metadata
        self._tasks: set[asyncio.Task] = set()

    @property
    def available(self) -> bool:
        return self._service is not None

    def follow(self, replicas: list[RunningReplica], loop: asyncio.AbstractEventLoop) -> None:
        """Subscribe to replicas newly advertising events; drop the ones gone."""
        advertised = {
            worker_id(r.replica_id): r.routing_stats[KV_EVENT_METADATA]
            for r in replicas
            if KV_EVENT_METADATA in r.routing_stats
        }
        for worker in self._workers.keys() - advertised.keys():
            self.forget(worker, loop)
        for worker, metadata in advertised.items():
            known = self._workers.get(worker)
            self._workers[worker] = metadata  # its adapters may have changed
            if self._service is not None and (known or {}).get("endpoint") != metadata["endpoint"]:
                self._run(loop, self._service.upsert_worker(self._worker(worker, metadata)))
        WORKERS.labels(self.model).set(len(self._workers))

    def forget_replica(self, replica: ReplicaID, loop: asyncio.AbstractEventLoop) -> None:
        self.forget(worker_id(replica), loop)

    def forget(self, worker: int, loop: asyncio.AbstractEventLoop) -> None:
        if self._workers.pop(worker, None) is not None and self._service is not None:
            self._run(loop, self._service.delete_worker(worker))
            log.info("kv_aware %s: replica's blocks left the index", self.model)
        WORKERS.labels(self.model).set(len(self._workers))

    def lora_name(self, adapter: str | None) -> str | None:
        """The name the engines gave the adapter's blocks (its task id)."""
        if adapter is None:
            return None
        for metadata in self._workers.values():
            if adapter in metadata.get("adapters", {}):
                return metadata["adapters"][adapter]
        return None

    def block_size(self, workers: list[int]) -> int:
        """The engines' block size (one engine configuration per model)."""
        return self._workers[workers[0]]["block_size"] if workers else 1

    def follows(self, worker: int) -> bool:
        """Whether the index has the worker's events (none without Dynamo's wheel)."""
        return self._service is not None and worker in self._workers

    async def overlaps(self, token_ids: list[int], lora_name: str | None) -> dict[int, int]:
        """Each worker's cached tokens of the prompt (absent: none)."""
        request = {"model_name": self.model, "tenant_id": _TENANT, "token_ids": token_ids}
        if lora_name is not None:
            request["lora_name"] = lora_name
        scores = await self._service.overlap_scores(request)
        return {
            w["worker_id"]: w.get("device_blocks", 0) * self._workers[w["worker_id"]]["block_size"]
            for w in scores["workers"]
            if w["worker_id"] in self._workers
        }

    def _worker(self, worker: int, metadata: dict) -> dict:
        return {
            "worker_id": worker,
            "model_name": self.model,
            "tenant_id": _TENANT,
            "endpoint": metadata["endpoint"],  # an id to Dynamo: it dials the two below
            "block_size": metadata["block_size"],
            "max_num_batched_tokens": metadata["max_num_batched_tokens"],
            "data_parallel_start_rank": 0,
            "data_parallel_size": 1,
            "kv_events_endpoints": {0: metadata["endpoint"]},
            "replay_endpoint": metadata["replay_endpoint"],
        }

    def _run(self, loop: asyncio.AbstractEventLoop, awaitable) -> None:
        async def run():
            try:
                await awaitable
            except Exception as error:  # the index is an optimisation: route on
                log.warning("kv_aware %s: the index refused a change: %s", self.model, error)

        task = loop.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _selection_service(model: str):
    # Dynamo's Rust logs every choice at INFO: a line per request in the ingress.
    os.environ.setdefault("DYN_LOG", "warn")
    try:
        from dynamo.llm import SelectionService  # noqa: PLC0415 (a 75 MB extension)
    except ImportError as error:
        log.warning(
            "routing: kv_aware for %s routes by load: Dynamo's indexer is not installed "
            "(pip install ai-dynamo-runtime): %s",
            model,
            error,
        )
        return None
    return SelectionService(indexer_threads=1)


class PromptTokens:
    """The token ids the engine reads for a request, tokenized as its preprocessing
    does (the tokenizer loads on first use)."""

    def __init__(self, repository_dir: str):
        self._repository = Path(repository_dir)
        self._tokenizer = None
        self._add_special_tokens = True

    async def of(self, params) -> list[int]:
        if params.prompt_token_ids:
            return list(params.prompt_token_ids)
        if not params.prompt:
            return []
        return await asyncio.to_thread(self._encode, params.prompt)

    def _encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            self._add_special_tokens = repository.adds_special_tokens(self._repository)
            self._tokenizer = repository.load_tokenizer(self._repository)
        return tokenization.encode(self._tokenizer, text, self._add_special_tokens)


class PlacedPrefixes:
    """The prompts routed in the last ``ttl_s`` seconds, by their blocks, per replica: what
    an engine is about to hold before its events say so.

    Without it a prompt arriving while another of the same prefix waits for its prefill
    (a tenant's second conversation beside its first) looks new to the index, and lands
    where the new prefixes go: often the other replica, which then holds the tenant too.
    ``prefix_aware`` has no such window (it records the text when it routes); Dynamo's
    index records only what engines publish, so this short record is kept here.
    """

    def __init__(self, ttl_s: float = PLACED_TTL_S, max_blocks: int = 1 << 16):
        self._ttl_s = ttl_s
        self._max_blocks = max_blocks
        self._placed: OrderedDict[tuple[int, int], float] = OrderedDict()  # (block, worker)

    def add(self, blocks: list[int], worker: int) -> None:
        now = time.monotonic()
        for block in blocks:
            key = (block, worker)
            self._placed[key] = now
            self._placed.move_to_end(key)
        self._expire(now)

    def held(self, blocks: list[int], workers: list[int]) -> dict[int, int]:
        """Each worker's blocks of the prompt placed there lately, from its first on."""
        self._expire(time.monotonic())
        held = {}
        for worker in workers:
            count = 0
            while count < len(blocks) and (blocks[count], worker) in self._placed:
                count += 1
            if count:
                held[worker] = count
        return held

    def _expire(self, now: float) -> None:
        placed = self._placed
        while placed and (
            len(placed) > self._max_blocks or next(iter(placed.values())) < now - self._ttl_s
        ):
            placed.popitem(last=False)


def block_keys(token_ids: list[int], block_size: int, lora_name: str | None) -> list[int]:
    """The prompt's full blocks, each a key for its whole prefix (the engine caches full
    blocks only); in-process keys, compared with :class:`PlacedPrefixes` only."""
    keys, previous = [], hash(lora_name)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, *token_ids[start : start + block_size]))
        keys.append(previous)
    return keys


class KvScorer:
    """The replicas of a model to route a request among, by what their engines hold."""

    def __init__(self, model: str, repository_dir: str):
        self.model = model
        self.index = KvIndex(model)
        self.placed = PlacedPrefixes()
        self._prompts = PromptTokens(repository_dir)
        self._written: dict[int, int] = {}  # worker -> tokens of the new prefixes placed there
        # A request being routed -> its blocks (until Serve says where it went); a
        # retried choice (the chosen replicas full) reuses its tokens, counted once.
        self._routing: OrderedDict[str, tuple[list[int], list[int]]] = OrderedDict()
        self._warned: set[str] = set()

    def routed(self, how: str) -> None:
        ROUTED.labels(self.model, how).inc()

    async def choose(
        self, candidates: list[RunningReplica], params, request_id: str = ""
    ) -> list[RunningReplica]:
        """The candidates to route the request (``params``, a GenerateParams) among:
        those whose engines hold, or were just sent, the longest prefix of its tokens
        where that is a tenth of them; else the one sent the fewest tokens of new
        prefixes, so that new prefixes spread over the caches as ``prefix_aware``
        spreads them over its smallest trees. Empty where nothing can say (no indexer,
        no tokens, no candidate in the index, an adapter no replica named yet)."""
        with CHOICE_SECONDS.labels(self.model).time():
            return await self._choose(candidates, params, request_id)

    async def _choose(self, candidates, params, request_id: str) -> list[RunningReplica]:
        by_worker = {worker_id(r.replica_id): r for r in candidates}
        known = [w for w in by_worker if self.index.follows(w)]
        lora_name = self.index.lora_name(params.adapter)
        unnamed = params.adapter is not None and lora_name is None
        retried = request_id in self._routing
        if retried:
            token_ids, blocks = self._routing[request_id]
        else:
            token_ids = await self._prompts.of(params) if known and not unnamed else []
            blocks = block_keys(token_ids, self.index.block_size(known), lora_name)
        held = await self._held(token_ids, blocks, lora_name, known) if token_ids else None
        if held is None:
            self.routed("no_index")
            return []
        if request_id and not retried:
            self._remember(request_id, token_ids, blocks)
        chosen, how, best = self._pick(known, held, len(token_ids), counted=retried)
        if not retried:
            self._count(how, len(token_ids), best)
        return [by_worker[w] for w in chosen]

    def placed_on(self, request_id: str, replica: ReplicaID) -> None:
        """Serve sent the request to ``replica``: its blocks count as held there."""
        _, blocks = self._routing.pop(request_id, (None, None))
        if blocks:
            self.placed.add(blocks, worker_id(replica))

    async def _held(self, token_ids, blocks, lora_name, known) -> dict | None:
        """Each worker's (held tokens of the prompt, whether only just placed there)."""
        overlaps = await self._overlaps(token_ids, lora_name)
        if overlaps is None:
            return None
        block_size = self.index.block_size(known)
        placed = self.placed.held(blocks, known)
        held = {}
        for worker in known:
            published, sent = overlaps.get(worker, 0), placed.get(worker, 0) * block_size
            held[worker] = (max(published, sent), sent > published)
        return held

    def _pick(self, known, held, prompt_tokens, counted: bool) -> tuple[list[int], str, int]:
        """The chosen workers, how, and the tokens they hold (``counted``: a retried
        choice, whose new prefix was counted where first placed)."""
        best = max(tokens for tokens, _ in held.values())
        if best >= NEW_PREFIX_SHARE * prompt_tokens:
            chosen = [w for w in known if held[w][0] == best]
            return chosen, "placed" if held[chosen[0]][1] else "overlap", best
        worker = self._least_written(known)
        self._written[worker] += 0 if counted else prompt_tokens
        tokens = held[worker][0]
        return [worker], "overlap" if tokens else "no_overlap", tokens

    def _count(self, how: str, prompt_tokens: int, overlap: int) -> None:
        PROMPT_TOKENS.labels(self.model).inc(prompt_tokens)
        OVERLAP_TOKENS.labels(self.model).inc(overlap)
        OVERLAP_SHARE.labels(self.model).observe(min(overlap / prompt_tokens, 1.0))
        self.routed(how)

    def _remember(self, request_id: str, token_ids: list[int], blocks: list[int]) -> None:
        self._routing[request_id] = (token_ids, blocks)
        if len(self._routing) > 1024:  # requests Serve never reported routed (cancelled)
            self._routing.popitem(last=False)

    async def _overlaps(self, token_ids: list[int], lora_name) -> dict[int, int] | None:
        try:
            return await self.index.overlaps(token_ids, lora_name)
        except Exception as error:  # noqa: BLE001 (e.g. no replica subscribed yet: by load)
            if str(error) not in self._warned:  # once per reason, not per request
                self._warned.add(str(error))
                log.warning("kv_aware %s: routing by load: the index says %s", self.model, error)
            return None

    def _least_written(self, known: list[int]) -> int:
        floor = min(self._written.values(), default=0)
        for worker in known:  # a new replica starts level with the least written
            self._written.setdefault(worker, floor)
        return min(known, key=self._written.__getitem__)
