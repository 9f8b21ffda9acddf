"""Liveness, readiness, model info, sleep status and Prometheus metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from rollout_server.protocol import HealthResponse, InfoResponse, SleepStatus
from rollout_server.status.service import StatusService

router = APIRouter(tags=["status"])


def get_status(request: Request) -> StatusService:
    return request.app.state.status


StatusDep = Annotated[StatusService, Depends(get_status)]


@router.get("/health", response_model=HealthResponse)
async def health() -> HealthResponse:
    """The process is up (the model may still be loading: see /ready)."""
    return HealthResponse()


@router.get("/ready", response_model=HealthResponse, responses={503: {"description": "not ready"}})
async def ready(status: StatusDep) -> HealthResponse:
    """200 once the engine is loaded, awake and holding valid weights; 503 otherwise."""
    status.core.require_ready()
    return HealthResponse()


@router.get("/info", response_model=InfoResponse)
async def info(status: StatusDep) -> InfoResponse:
    return status.info()


@router.get("/is_sleeping", response_model=SleepStatus)
async def is_sleeping(status: StatusDep) -> SleepStatus:
    return status.core.sleep_status()


@router.get("/metrics", response_class=Response)
async def metrics(status: StatusDep) -> Response:
    body, content_type = status.core.metrics.render()
    return Response(body, media_type=content_type)
