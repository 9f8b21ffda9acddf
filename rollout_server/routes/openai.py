"""OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter

from rollout_server.errors import BadRequest
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


@contextlib.contextmanager
def _prompts_called(old: str, new: str) -> Iterator[None]:
    """The service names its prompts ``prompts[i]``; an OpenAI request calls them otherwise."""
    try:
        yield
    except BadRequest as e:
        raise BadRequest(e.detail.replace(old, new), headers=e.headers) from None


@router.post("/completions")
async def completions(request: CompletionRequest, service: ServiceDep) -> dict[str, Any]:
    """Any ``model`` name is accepted: a server serves one model."""
    service.require_loaded()
    with _prompts_called("prompts[", "prompt["):
        resp = await service.generate(request.to_generate(default_max_tokens=16))
    return completion_response(resp, service.settings.name, request.logprobs, _token_text(service))


@router.post("/chat/completions")
async def chat_completions(request: ChatCompletionRequest, service: ServiceDep) -> dict[str, Any]:
    service.require_loaded()
    default = service.limits.max_tokens
    with _prompts_called("prompts[0]", "messages (the rendered chat prompt)"):
        resp = await service.generate(request.to_generate(default_max_tokens=default))
    return chat_response(resp, service.settings.name, request, _token_text(service))
