"""What operators probe and scrape: ``GET /health`` and ``GET /metrics``.

/health needs no API key: probes (Docker's healthcheck, Kubernetes' readinessProbe)
carry none, and it says no more than which configured model is not ready.

/metrics asks for the API key when keys are configured, as /v1/* does, but takes none
of the key's tenant's limits: a scrape is not the tenant's traffic. The API port
is the public one (compose publishes it, the RayService's Ingress routes ``/`` to it),
and the figures (traffic per model, replica ids, Triton's model names) are for the
operator, not the clients; Prometheus sends a key with ``authorization:
{credentials_file: ...}`` in its scrape config. vLLM leaves its /metrics open
whatever ``--api-key`` says; with no key configured (loopback use) ours is open too.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from serve.api.common.auth import require_api_key_alone
from serve.api.common.errors import NotReady
from serve.metrics import CONTENT_TYPE

operations_router = APIRouter()


@operations_router.get("/health")
async def health(request: Request):
    """200 once every configured model has a running replica (whose Triton reported
    the model ready and passes Serve's health checks), else 503 (an OpenAI error
    object) naming the models that are not. Serve's own ``/-/healthz`` says only that
    the proxy is up. A rate limits' store that cannot be reached is said in the 200,
    or is a 503 where it refuses requests (``on_store_error: closed``)."""
    backend = request.app.state.backend
    waiting = await backend.not_ready()
    if waiting:
        reasons = "; ".join(f"{model}: {reason}" for model, reason in sorted(waiting.items()))
        raise NotReady(f"not ready: {reasons}", param="model", code="model_not_ready")
    ready = {"status": "ready", "models": [m.id for m in backend.config.models]}
    buckets = request.app.state.buckets
    if not await buckets.reachable_now():
        # Closed: every request under a limit is a 503 now, so the replica is not ready.
        if not buckets.fail_open:
            raise NotReady(
                "not ready: the rate limits' store (Redis) cannot be reached, and "
                "rate_limits.on_store_error is closed",
                code="rate_limits_unavailable",
            )
        ready["rate_limits"] = "the store (Redis) cannot be reached: requests are not limited"
    return ready


@operations_router.get("/metrics", dependencies=[Depends(require_api_key_alone)])
async def metrics(request: Request):
    """Prometheus text of the whole application (docs/metrics.md)."""
    text = await request.app.state.backend.metrics_text()
    return Response(text, media_type=CONTENT_TYPE)
