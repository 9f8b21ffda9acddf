"""Liveness, readiness, model info, sleep status and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response

from rollout_server.protocol import HealthResponse, InfoResponse, SleepStatus
from rollout_server.routes.deps import ServiceDep

router = APIRouter(tags=["status"])


@router.get("/health", response_model=HealthResponse)
async def health() -> HealthResponse:
    """The process is up (the model may still be loading: see /ready)."""
    return HealthResponse()


@router.get("/ready", response_model=HealthResponse, responses={503: {"description": "not ready"}})
async def ready(service: ServiceDep) -> HealthResponse:
    """200 once the engine is loaded, awake and holding valid weights; 503 otherwise."""
    service.require_ready()
    return HealthResponse()


@router.get("/info", response_model=InfoResponse)
async def info(service: ServiceDep) -> InfoResponse:
    return service.info()


@router.get("/is_sleeping", response_model=SleepStatus)
async def is_sleeping(service: ServiceDep) -> SleepStatus:
    return service.sleep_status()


@router.get("/metrics", response_class=Response)
async def metrics(service: ServiceDep) -> Response:
    body, content_type = service.metrics.render()
    return Response(body, media_type=content_type)
