"""OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter

from rollout_server.errors import BadRequest
from rollout_server.generation.router import GENERATION_ERRORS, GenerationDep, json_example
from rollout_server.generation.service import GenerationService
from rollout_server.openai_compat.protocol import ChatCompletionRequest, CompletionRequest
from rollout_server.openai_compat.serving import TokenText, chat_response, completion_response
from rollout_server.status.router import StatusDep

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
async def models(status: StatusDep) -> dict[str, Any]:
    info = status.info()
    card = {
        "id": info.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "rollout-server",
        "max_model_len": info.max_model_len,
    }
    return {"object": "list", "data": [card]}


def _token_text(generation: GenerationService) -> TokenText:
    engine = generation.core.engine
    return lambda token_id: engine.decode([token_id])


@contextlib.contextmanager
def _prompts_called(old: str, new: str) -> Iterator[None]:
    """Generation names its prompts ``prompts[i]``; an OpenAI request calls them otherwise."""
    try:
        yield
    except BadRequest as e:
        raise BadRequest(e.detail.replace(old, new), headers=e.headers) from None


@router.post(
    "/completions",
    responses=GENERATION_ERRORS,
    openapi_extra=json_example({"prompt": "What is 7 * 6?", "max_tokens": 8}),
)
async def completions(request: CompletionRequest, generation: GenerationDep) -> dict[str, Any]:
    """Any ``model`` name is accepted: a server serves one model."""
    core = generation.core
    core.require_loaded()
    with _prompts_called("prompts[", "prompt["):
        resp = await generation.generate(request.to_generate(default_max_tokens=16))
    token_text = _token_text(generation)
    return completion_response(resp, core.settings.name, request.logprobs, token_text)


@router.post(
    "/chat/completions",
    responses=GENERATION_ERRORS,
    openapi_extra=json_example(
        {"messages": [{"role": "user", "content": "What is 7 * 6?"}], "max_tokens": 8}
    ),
)
async def chat_completions(
    request: ChatCompletionRequest, generation: GenerationDep
) -> dict[str, Any]:
    core = generation.core
    core.require_loaded()
    default = core.limits.max_tokens
    with _prompts_called("prompts[0]", "messages (the rendered chat prompt)"):
        resp = await generation.generate(request.to_generate(default_max_tokens=default))
    return chat_response(resp, core.settings.name, request, _token_text(generation))
