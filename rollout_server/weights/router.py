"""Weight updates: one safetensors blob, staged buckets, a file path, NCCL or CUDA IPC (admin
routes).

Every update is validated whole before the pause; the version moves only once all of it
loaded; a refused update answers 4xx naming the problem while the old weights keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from rollout_server.engine.base import UnsupportedError, WeightsError
from rollout_server.errors import ServiceError
from rollout_server.protocol import (
    INT64_MAX,
    MAX_BUCKETS,
    ErrorResponse,
    IpcUpdateRequest,
    NcclCommitRequest,
    NcclInitRequest,
    NcclPrepared,
    NcclUpdateRequest,
    WeightChecksum,
    WeightFileRequest,
    WeightUpdateBegin,
    WeightUpdateCommit,
    WeightUpdateId,
    WeightUpdateResponse,
)
from rollout_server.weights.paths import WeightDirs
from rollout_server.weights.service import WeightsService
from rollout_server.weights.validation import parse_safetensors, read_safetensors_path

router = APIRouter(prefix="/weights", tags=["weights"])


def get_weights(request: Request) -> WeightsService:
    return request.app.state.weights


WeightsDep = Annotated[WeightsService, Depends(get_weights)]

_BLOB = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}
_ERRORS = {
    400: {
        "model": ErrorResponse,
        "description": "unknown name, wrong dtype/shape, NaN/inf, bad payload",
    },
    409: {"model": ErrorResponse, "description": "stale version, weights asleep, bucket order"},
    413: {"model": ErrorResponse, "description": "body larger than max_body_mb"},
}
_NO_UPDATE = {
    404: {"model": ErrorResponse, "description": "no open update with this id (committed, aborted)"}
}
_UNSUPPORTED = {
    501: {"model": ErrorResponse, "description": "not supported by this engine or its settings"}
}

# OpenAPI links: a client (and the stateful fuzzer) learns that begin's update_id feeds the
# bucket, commit and abort of the same update.
_UPDATE_ID = "$response.body#/update_id"
_STAGED_LINKS = {
    "responses": {
        "200": {
            "links": {
                "bucket": {
                    "operationRef": "#/paths/~1weights~1bucket/post",
                    "parameters": {"update_id": _UPDATE_ID, "index": 0},
                },
                "commit": {
                    "operationRef": "#/paths/~1weights~1commit/post",
                    "requestBody": {"update_id": _UPDATE_ID, "num_buckets": 1},
                },
                "abort": {
                    "operationRef": "#/paths/~1weights~1abort/post",
                    "requestBody": {"update_id": _UPDATE_ID},
                },
            }
        }
    }
}
_BUCKET_LINKS = {
    "responses": {
        "200": {
            "links": {
                "commit": {
                    "operationRef": "#/paths/~1weights~1commit/post",
                    "requestBody": {"update_id": "$request.query.update_id", "num_buckets": 1},
                }
            }
        }
    }
}


@contextlib.contextmanager
def _counted(service: WeightsService, transport: str) -> Iterator[None]:
    """A refused update (bad body, tensors, version, state or transport) counts in
    ``rollout_weight_updates_total{result="refused"}``; a loaded one counts "ok" where it loads."""
    try:
        yield
    except (ServiceError, WeightsError, UnsupportedError):
        service.core.metrics.weight_updates.labels(transport, "refused").inc()
        raise


@router.post("/update", response_model=WeightUpdateResponse, responses=_ERRORS, openapi_extra=_BLOB)
async def update(
    request: Request,
    service: WeightsDep,
    version: int | None = Query(
        None, ge=0, le=INT64_MAX, description="version to set; default current + 1"
    ),
) -> WeightUpdateResponse:
    """A whole update in one safetensors body (``Content-Type: application/octet-stream``)."""
    with _counted(service, "http"):
        service.check_update_version(version)
        blob = await request.body()
        tensors = await asyncio.to_thread(parse_safetensors, blob)
        return await service.apply_weights(tensors, version, transport="http")


@router.post(
    "/begin", response_model=WeightUpdateId, responses=_ERRORS, openapi_extra=_STAGED_LINKS
)
async def begin(request: WeightUpdateBegin, service: WeightsDep) -> WeightUpdateId:
    """Open a multi-bucket update (supersedes any open one); nothing is applied until commit.
    With ``adapter``, the buckets hold a LoRA adapter served on the base weights."""
    with _counted(service, "http"):
        service.check_update_version(request.version)
        return WeightUpdateId(update_id=service.stager.begin(request.version, request.adapter))


@router.post("/bucket", responses=_ERRORS | _NO_UPDATE, openapi_extra=_BLOB | _BUCKET_LINKS)
async def bucket(
    request: Request,
    service: WeightsDep,
    update_id: str = Query(...),
    index: int = Query(..., ge=0, lt=MAX_BUCKETS),
) -> dict[str, int]:
    """One bucket (a safetensors body), validated on arrival and staged on CPU."""
    with _counted(service, "http"):
        service.stager.get(update_id)
        blob = await request.body()
        tensors = await asyncio.to_thread(parse_safetensors, blob, what=f"bucket {index}")
        service.stager.add_bucket(update_id, index, tensors, service.core.engine.weight_metadata())
        return {"index": index, "num_tensors": len(tensors)}


@router.post("/commit", response_model=WeightUpdateResponse, responses=_ERRORS | _NO_UPDATE)
async def commit(request: WeightUpdateCommit, service: WeightsDep) -> WeightUpdateResponse:
    """Apply every staged bucket under the pause, then bump the version.

    The update is closed by a commit even if the commit is refused (stale version): send it
    again from ``/weights/begin``."""
    with _counted(service, "http"):
        staged = service.stager.take_complete(request.update_id, request.num_buckets)
        if staged.adapter is not None:
            return await service.apply_adapter(
                staged.adapter, staged.tensors(), staged.version, transport="http"
            )
        return await service.apply_weights(
            staged.tensors(), staged.version, transport="http", values_checked=True
        )


@router.post("/abort", responses={404: {"model": ErrorResponse}})
async def abort(request: WeightUpdateId, service: WeightsDep) -> dict[str, str]:
    service.stager.abort(request.update_id)
    return {"aborted": request.update_id}


@router.post("/load_file", response_model=WeightUpdateResponse, responses=_ERRORS)
async def load_file(request: WeightFileRequest, service: WeightsDep) -> WeightUpdateResponse:
    """Load a .safetensors file, or every one in a directory, from the model's directory or
    ``--weights-dir`` on the server's disk; with ``adapter``, a LoRA adapter."""
    with _counted(service, "file"):
        service.check_update_version(request.version)
        dirs = WeightDirs.of(service.core.settings)
        tensors = await asyncio.to_thread(read_safetensors_path, request.path, dirs)
        if request.adapter is not None:
            return await service.apply_adapter(
                request.adapter, tensors, request.version, transport="file"
            )
        return await service.apply_weights(tensors, request.version, transport="file")


@router.get(
    "/checksum",
    response_model=WeightChecksum,
    responses={
        409: {"model": ErrorResponse, "description": "weights asleep"},
        500: {"model": ErrorResponse, "description": "the served weights hold NaN/inf"},
    }
    | _UNSUPPORTED,
)
async def checksum(service: WeightsDep) -> WeightChecksum:
    """A checksum of the weights being served, to compare with the learner's after a sync."""
    return await service.weights_checksum()


@router.post("/nccl/init", responses=_UNSUPPORTED)
async def nccl_init(request: NcclInitRequest, service: WeightsDep) -> dict[str, bool]:
    """Join the learner's weight-sync process group (engines with NCCL support only)."""
    await service.init_weight_group(request)
    return {"ok": True}


@router.post(
    "/nccl/update",
    response_model=WeightUpdateResponse,
    responses=_ERRORS | _UNSUPPORTED,
)
async def nccl_update(request: NcclUpdateRequest, service: WeightsDep) -> WeightUpdateResponse:
    """Announce a whole update, then receive its buckets over NCCL and load them all."""
    with _counted(service, "nccl"):
        return await service.nccl_update(request)


@router.post(
    "/nccl/prepare",
    response_model=NcclPrepared,
    responses=_ERRORS | _UNSUPPORTED,
)
async def nccl_prepare(request: NcclUpdateRequest, service: WeightsDep) -> NcclPrepared:
    """Announce an update ahead of its broadcast: generation pauses (once the requests in
    flight finish), the workers queue its receives and the prefix cache is reset. Until the
    update is committed new generations wait, as behind any load; other weight updates, sleep
    and wake_up answer 409."""
    with _counted(service, "nccl"):
        return await service.nccl_prepare(request)


@router.post(
    "/nccl/commit",
    response_model=WeightUpdateResponse,
    responses=_ERRORS | _UNSUPPORTED,
)
async def nccl_commit(request: NcclCommitRequest, service: WeightsDep) -> WeightUpdateResponse:
    """Wait for the prepared update's broadcast, load all of it (or none), bump the version
    and resume generation. It may be posted before the broadcast: the workers then wait for
    the bytes, at most the weight-sync group's timeout."""
    with _counted(service, "nccl"):
        return await service.nccl_commit(request)


@router.post(
    "/ipc/update",
    response_model=WeightUpdateResponse,
    responses=_ERRORS | _UNSUPPORTED,
)
async def ipc_update(request: IpcUpdateRequest, service: WeightsDep) -> WeightUpdateResponse:
    """Colocated learner: load buckets shared as CUDA IPC handles from the learner's memory on
    this server's GPU (the learner keeps them alive until this answers)."""
    with _counted(service, "ipc"):
        return await service.ipc_update(request)
