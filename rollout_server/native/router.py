"""vLLM's RL routes (vLLM 0.24's ``serve/dev/rlhf`` and its weight-transfer engines), so that a
trainer written for ``vllm serve`` drives this server unchanged (admin routes: removed by
``--disable-admin-endpoints``, behind the API key like every route).

Stronger than vLLM's: the tensors of ``/update_weights`` are staged and ``/finish_weight_update``
applies them all at once, validated whole (names, shapes, NaN/inf), as a new weight version
(current + 1); a failed receive or a refused update leaves the served weights and version as
they were. Steps out of order answer 409.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from rollout_server.native.service import NativeService, PauseMode
from rollout_server.protocol import (
    INT64_MAX,
    ErrorResponse,
    IsPaused,
    PauseStatus,
    StartWeightUpdateRequest,
    UpdateWeightsRequest,
    WeightTransferInitRequest,
    WeightTransferMessage,
    WorldSize,
)

router = APIRouter(tags=["vLLM RL weight transfer"])


def get_native(request: Request) -> NativeService:
    return request.app.state.native


NativeDep = Annotated[NativeService, Depends(get_native)]

_ORDER = {409: {"model": ErrorResponse, "description": "a step out of order, or one in progress"}}
_BAD = {400: {"model": ErrorResponse, "description": "a field of init_info/update_info is invalid"}}
_PEER = {
    502: {
        "model": ErrorResponse,
        "description": "the trainer did not join or did not send (died, closed, timed out); "
        "nothing was applied",
    }
}
_UNSUPPORTED = {
    501: {"model": ErrorResponse, "description": "the vllm engine runs without a backend"}
}


@router.post("/pause", response_model=PauseStatus)
async def pause(service: NativeDep, mode: PauseMode = Query("abort")) -> PauseStatus:
    """New generations wait (they queue, none fails) until ``/resume``; answers once no
    generation is in flight. ``abort`` (the default, as in vLLM) cancels the ones in flight:
    each answers 503, to be sent again after ``/resume``. ``wait`` lets them finish, and so does
    ``keep`` on this server (it cannot freeze them mid-decode). Weight updates still load while
    paused."""
    await service.pause(mode)
    return PauseStatus(status="paused")


@router.post("/resume", response_model=PauseStatus)
async def resume(service: NativeDep) -> PauseStatus:
    await service.resume()
    return PauseStatus(status="resumed")


@router.get("/is_paused", response_model=IsPaused)
async def is_paused(service: NativeDep) -> IsPaused:
    return IsPaused(is_paused=service.is_paused())


@router.get("/get_world_size", response_model=WorldSize)
async def get_world_size(service: NativeDep, include_dp: bool = Query(True)) -> WorldSize:
    """The server's workers that join a weight-transfer group (1 on the transformers engine)."""
    return WorldSize(world_size=service.world_size(include_dp))


@router.post(
    "/init_weight_transfer_engine",
    response_model=WeightTransferMessage,
    responses=_BAD | _ORDER | _PEER | _UNSUPPORTED,
)
async def init_weight_transfer_engine(
    request: WeightTransferInitRequest, service: NativeDep
) -> WeightTransferMessage:
    """Join the trainer's group (the trainer, rank 0, hosts it at master_address:master_port;
    this server's worker is rank ``rank_offset``); answers once every rank joined. A new group
    replaces the previous one and drops an update left open."""
    await service.init(request.init_info)
    return WeightTransferMessage(message="Weight transfer initialized")


@router.post(
    "/start_weight_update",
    response_model=WeightTransferMessage,
    responses=_ORDER | _UNSUPPORTED,
)
async def start_weight_update(
    service: NativeDep, request: StartWeightUpdateRequest | None = None
) -> WeightTransferMessage:
    """Open an update (409 while one is open, or without a group)."""
    await service.start((request or StartWeightUpdateRequest()).is_checkpoint_format)
    return WeightTransferMessage(message="Weight update started")


@router.post(
    "/update_weights",
    response_model=WeightTransferMessage,
    responses=_BAD | _ORDER | _PEER | _UNSUPPORTED,
)
async def update_weights(
    request: UpdateWeightsRequest, service: NativeDep
) -> WeightTransferMessage:
    """Receive the announced tensors (one broadcast each from rank 0, in ``names``' order) and
    stage them. Checked before anything is received: the lists of equal length, each name a
    parameter of the model with that shape and a known dtype (cast to the parameter's),
    dense and unpacked on the gloo backend. A failed receive drops the staged tensors and the
    group (init again); the served weights are untouched."""
    await service.update(request.update_info)
    return WeightTransferMessage(message="Weights updated")


@router.post(
    "/finish_weight_update",
    response_model=WeightTransferMessage,
    responses=_BAD | _ORDER | _UNSUPPORTED,
)
async def finish_weight_update(
    service: NativeDep,
    version: int | None = Query(
        None,
        ge=0,
        le=INT64_MAX,
        description="ours (vLLM ignores it): the version to serve "
        "(newer than the current one); default current + 1",
    ),
) -> WeightTransferMessage:
    """Apply the staged tensors at once, validated whole (NaN/inf refused), as version current
    + 1 (or ``version``); on a refusal the previous weights keep serving. Nothing staged: no
    new version."""
    await service.finish(version)
    return WeightTransferMessage(message="Weight update finished")
