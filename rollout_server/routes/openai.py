"""OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from rollout_server.openai_compat import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_response,
    completion_response,
)
from rollout_server.routes.deps import ServiceDep

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
async def models(service: ServiceDep) -> dict[str, Any]:
    info = service.info()
    card = {
        "id": info.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "rollout-server",
        "max_model_len": info.max_model_len,
    }
    return {"object": "list", "data": [card]}


def _token_text(service):
    return lambda token_id: service.engine.decode([token_id])


@router.post("/completions")
async def completions(request: CompletionRequest, service: ServiceDep) -> dict[str, Any]:
    """Any ``model`` name is accepted: a server serves one model."""
    service.require_loaded()
    resp = await service.generate(request.to_generate(default_max_tokens=16))
    return completion_response(resp, service.settings.name, request.logprobs, _token_text(service))


@router.post("/chat/completions")
async def chat_completions(request: ChatCompletionRequest, service: ServiceDep) -> dict[str, Any]:
    service.require_loaded()
    default = service.limits.max_tokens
    resp = await service.generate(request.to_generate(default_max_tokens=default))
    return chat_response(resp, service.settings.name, request, _token_text(service))
