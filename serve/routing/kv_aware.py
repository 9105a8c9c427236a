"""routing: kv_aware: each request goes to the replica whose engine holds the longest
prefix of its prompt, as the engines' own KV cache events say (Dynamo's indexer).

``prefix_aware`` (Ray's PrefixCacheAffinityRouter) keeps a tree of the prompt *texts*
each replica was sent: blocks an engine evicted still attract their prompts, and a
replacement replica looks empty while the tree still points at its predecessor. Here
each engine publishes what it stores and evicts (tritonllm/engine/kv_events.py, the
format of vLLM's and TensorRT-LLM's events), each replica advertises where through
Serve's routing stats (``record_routing_stats``: serve/engines/triton/kv_events.py),
and this router keeps Dynamo's ``SelectionService`` (the indexer Ray Serve LLM's own
``KVAwareRouter`` scores with) subscribed to the replicas Serve reports running: a
replica that leaves takes its blocks out of the index, a new one starts empty, and a
router that starts late (a restarted ingress) gets what it missed from each engine's
replay socket.

Ray's ``KVAwareRouter`` is not used: it needs Ray Serve LLM's ingress (its token
tracker lives in ``LLMRouter``) and HAProxy's direct streaming, routes one model, and
knows no LoRA adapters. This one is a router per model deployment (each model of the
app routes by its own index), keeps Serve's multiplexing (an adapter's requests go
among the replicas holding it, and score against its own blocks: the engine names an
adapter's blocks by its task id, which the replicas advertise by name), and scores the
token ids the engine will read: the client's, a resumed stream's (its prompt and what
it already generated: a moved stream goes where its prefix is) or the prompt text's,
tokenized off the event loop with the preprocessing's tokenizer.

Where an engine holds at least a tenth of the prompt, the replicas holding the
longest prefix are the choice (Serve takes the shorter queue among them), counting as
held what was routed there in the last half minute and not yet published (a prompt
waiting for its prefill: kv_index.PlacedPrefixes); else the
replica sent the fewest tokens of new prefixes, so that new prefixes spread over the
caches as ``prefix_aware`` spreads them over its smallest trees. Serve's own
queue lengths have the last word, as in ``prefix_aware``: while the candidates' queues
differ by more than one engine batch, power of two choices. (Dynamo's own scheduler,
``select_and_reserve`` with its load booked per request, was measured here and spread
``make bench-prefix``'s conversations by load: docs/prefix-caching.md.) Without
Dynamo's wheel the model routes by load, and says so once.
"""

from __future__ import annotations

import random

from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import (
    LocalityMixin,
    MultiplexMixin,
    RequestRouter,
)


class KvAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Serve's request router for ``routing: kv_aware`` (serve/app.py configures it)."""

    def initialize_state(self, model: str, repository_dir: str, imbalanced_threshold: int):
        from serve.routing.kv_index import KvScorer  # where the router runs (kv_index.py)

        self._scorer = KvScorer(model, repository_dir)
        self._imbalanced_threshold = imbalanced_threshold

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._scorer.index.follow(replicas, self._event_loop)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._scorer.index.forget_replica(replica_id, self._event_loop)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        candidates = self._allowed(candidate_replicas, pending_request)
        if len(candidates) < 2:
            return [candidates]
        by_load = [random.sample(candidates, 2)]  # power of two choices
        if await self._imbalanced(candidates):
            self._scorer.routed("imbalanced")
            return by_load
        params = pending_request.args[0] if pending_request.args else None
        request_id = pending_request.metadata.internal_request_id
        chosen = await self._scorer.choose(candidates, params, request_id) if params else []
        return [chosen] if chosen else by_load

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        super().on_request_routed(pending_request, replica_id, result)
        self._scorer.placed_on(pending_request.metadata.internal_request_id, replica_id)

    def _allowed(self, candidates: list[RunningReplica], pending_request: PendingRequest):
        """The candidates Serve's multiplexing (an adapter's holders) or locality allows
        (one call of its helper: a second sees its own mark, serve/routing/prefix_aware.py)."""
        if pending_request.metadata.multiplexed_model_id:
            allowed = self.apply_multiplex_routing(pending_request=pending_request)
        else:
            allowed = self.apply_locality_routing(pending_request=pending_request)
        return [r for r in candidates if r.replica_id in allowed] or candidates

    async def _imbalanced(self, candidates: list[RunningReplica]) -> bool:
        """Whether the candidates' queues are more than the threshold apart (Serve's
        cached queue lengths, probed where it has none)."""
        lengths, unknown = [], []
        for replica in candidates:
            length = self._replica_queue_len_cache.get(replica.replica_id)
            if length is None:
                unknown.append(replica)
            else:
                lengths.append(length)
        if unknown:
            probed = await self._probe_queue_lens(unknown, 0)
            lengths += [length for _, length in probed if length is not None]
        return bool(lengths) and max(lengths) - min(lengths) > self._imbalanced_threshold
