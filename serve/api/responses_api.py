"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from serve.api.auth import require_api_key

responses_router = APIRouter(dependencies=[Depends(require_api_key)])
