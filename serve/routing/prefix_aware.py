"""routing: prefix_aware: Ray's PrefixCacheAffinityRouter, kept within Serve's
multiplexing for a pool of variants.

Ray 2.60's router breaks multiplexing in two ways, so a variant's request could go to
a replica that must load that variant (and unload another):

- Its ``choose_replicas`` first runs the power-of-two-choices router, which calls
  ``apply_multiplex_routing`` and marks the request as having tried the replicas that
  hold its model; its own second call of the helper then sees that mark and returns
  the replicas holding the *fewest* models instead of those holding the variant.
- When a prompt matches under 10% of any candidate's prefix tree, it picks the
  replicas with the smallest trees among *all* replicas, not among the candidates.

This subclass calls the multiplexing helper once, runs Ray's prefix match on the
replicas it returned, and keeps only those among the chosen. Requests without a
variant go through Ray's router unchanged, except one whose prompt has no text (a
client's token ids): Ray's match divides by the text's length, and the request would
never be routed; it goes by power of two choices. The class is imported from its defining
module: the public alias ``ray.serve.llm.request_router`` imports ray.llm's
cloud-storage helpers, which need pyarrow (ray[llm]); this one needs only ray[serve].
"""

from __future__ import annotations

import random

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica


class VariantPrefixRouter(PrefixCacheAffinityRouter):
    """Prefix affinity among the replicas Serve's multiplexing allows for the request's
    variant (those holding it; after Serve's matching timeout, those holding fewest)."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and not _prompt_text(pending_request):
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self, candidate_replicas, pending_request
            )
        if pending_request is None or not pending_request.metadata.multiplexed_model_id:
            return await super().choose_replicas(candidate_replicas, pending_request)
        allowed = self.apply_multiplex_routing(pending_request=pending_request)
        candidates = [r for r in candidate_replicas if r.replica_id in allowed]
        if not candidates:
            return []
        (chosen,) = await self._prefix_match_best_replicas(pending_request, candidates)
        chosen = [r for r in chosen if r.replica_id in allowed]
        # Loads apart or no match among the allowed: power of two choices among them.
        return [chosen or random.sample(candidates, min(2, len(candidates)))]


def _prompt_text(pending_request: PendingRequest) -> str:
    """The text Ray's router would match (a GenerateParams' prompt; "" for none)."""
    params = pending_request.args[0] if pending_request.args else None
    return getattr(params, "prompt", "") or ""
