"""Typed dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from rollout_server.service import RolloutService


def get_service(request: Request) -> RolloutService:
    return request.app.state.service


ServiceDep = Annotated[RolloutService, Depends(get_service)]
