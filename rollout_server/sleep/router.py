"""``POST /sleep`` and ``POST /wake_up`` (admin: removed by ``--disable-admin-endpoints``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from rollout_server.protocol import SleepRequest, SleepStatus, WakeUpRequest
from rollout_server.sleep.service import SleepService

router = APIRouter(tags=["sleep"])


def get_sleep(request: Request) -> SleepService:
    return request.app.state.sleep


SleepDep = Annotated[SleepService, Depends(get_sleep)]


def _links(**targets: str) -> dict[str, Any]:
    """OpenAPI links from a 200 to the operations it changes the answers of."""
    links = {name: {"operationRef": ref} for name, ref in targets.items()}
    return {"responses": {"200": {"links": links}}}


_AFTER_SLEEP = _links(
    wake_up="#/paths/~1wake_up/post",
    generate="#/paths/~1generate/post",
    checksum="#/paths/~1weights~1checksum/get",
)
_AFTER_WAKE = _links(sleep="#/paths/~1sleep/post", generate="#/paths/~1generate/post")


@router.post("/sleep", response_model=SleepStatus, openapi_extra=_AFTER_SLEEP)
async def sleep(
    service: SleepDep,
    request: SleepRequest | None = None,
    level: int | None = Query(None, ge=1, le=2, description="vLLM's spelling; the body wins"),
    mode: Literal["abort", "wait", "keep"] = Query(
        "wait", description="vLLM's; the generations in flight always finish first here"
    ),
) -> SleepStatus:
    """Waits for in-flight generations, then offloads (level 1) or discards (level 2) the
    weights; generate answers 503 until ``/wake_up``. No body means level 1 (or ``?level=``,
    as vLLM's ``/sleep?level=1&mode=abort``)."""
    return await service.sleep(request.level if request else (level or 1))


@router.post("/wake_up", response_model=SleepStatus, openapi_extra=_AFTER_WAKE)
async def wake_up(
    service: SleepDep,
    request: WakeUpRequest | None = None,
    tags: list[Literal["weights", "kv_cache"]] | None = Query(
        None, description="vLLM's spelling (?tags=weights, repeatable); the body wins"
    ),
) -> SleepStatus:
    """Wake the given parts (default: all). After level 2, sync weights before generating."""
    return await service.wake_up(request.tags if request else (tags or None))
