"""Anthropic's Messages API: ``POST /v1/messages``."""

from __future__ import annotations

from fastapi import APIRouter

messages_router = APIRouter()
