"""``POST /generate``: the native batch API the learner uses."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from rollout_server.generation.service import GenerationService
from rollout_server.protocol import ErrorResponse, GenerateRequest, GenerateResponse

router = APIRouter(tags=["generate"])


def get_generation(request: Request) -> GenerationService:
    return request.app.state.generation


GenerationDep = Annotated[GenerationService, Depends(get_generation)]

GENERATION_ERRORS = {
    400: {"model": ErrorResponse, "description": "a limit or the vocabulary was exceeded"},
    500: {
        "model": ErrorResponse,
        "description": "NaN/inf log-probs: the served weights hold NaN/inf, or they or the "
        "request's sampling values overflow (the message says which it could be)",
    },
    503: {
        "model": ErrorResponse,
        "description": "loading, asleep, weights discarded, or aborted by /pause?mode=abort "
        "(send it again)",
    },
}


def json_example(example: dict[str, object]) -> dict[str, object]:
    """``openapi_extra`` giving a route's JSON body an example (/docs shows it, the fuzzer
    sends it)."""
    return {"requestBody": {"content": {"application/json": {"example": example}}}}


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses=GENERATION_ERRORS,
    openapi_extra=json_example({"prompts": ["What is 7 * 6?"], "n": 2, "max_tokens": 8}),
)
async def generate(request: GenerateRequest, generation: GenerationDep) -> GenerateResponse:
    """``n`` samples per prompt, with each sampled token's log-prob and the weight version."""
    return await generation.generate(request)
