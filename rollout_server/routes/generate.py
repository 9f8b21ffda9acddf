"""``POST /generate``: the native batch API the learner uses."""

from __future__ import annotations

from fastapi import APIRouter

from rollout_server.protocol import ErrorResponse, GenerateRequest, GenerateResponse
from rollout_server.routes.deps import ServiceDep

router = APIRouter(tags=["generate"])

_ERRORS = {
    400: {"model": ErrorResponse, "description": "a limit or the vocabulary was exceeded"},
    500: {"model": ErrorResponse, "description": "the served weights give NaN/inf log-probs"},
    503: {"model": ErrorResponse, "description": "loading, asleep, or weights discarded"},
}


@router.post("/generate", response_model=GenerateResponse, responses=_ERRORS)
async def generate(request: GenerateRequest, service: ServiceDep) -> GenerateResponse:
    """``n`` samples per prompt, with each sampled token's log-prob and the weight version."""
    return await service.generate(request)
