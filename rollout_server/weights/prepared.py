"""The one NCCL update that may be prepared ahead of its broadcast, from prepare to commit.

While it waits, its receives hold the weight-sync group and the staging buffers and generation
stays paused: nothing else may load weights or sleep (``refuse``). It is dropped, the pause
lifted and the group aborted, if its commit does not come within the group's timeout, if the
group is formed again, or if its commit fails.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from rollout_server.errors import Conflict
from rollout_server.protocol import NcclPrepared

if TYPE_CHECKING:
    from rollout_server.core import ServerCore
    from rollout_server.protocol import NcclInitRequest, NcclUpdateRequest

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class PreparedUpdate:
    """An NCCL update whose receives the workers queued ahead of the broadcast."""

    id: str
    request: NcclUpdateRequest
    num_bytes: int
    expiry: asyncio.TimerHandle | None = None  # None while the workers are still queuing
    # set once its commit arrived (the learner may post it before it broadcasts: the workers
    # then wait for the bytes, bounded by the group's timeout); done when the commit ended
    committing: asyncio.Event | None = None


class PreparedUpdates:
    def __init__(self, core: ServerCore) -> None:
        self.core = core
        self.current: PreparedUpdate | None = None
        self.group_timeout_s = 300.0  # the weight-sync group's (a prepared update's lifetime)

    def refuse(self, what: str) -> None:
        """Refuse ``what`` (409) while an update is prepared or being committed."""
        prepared = self.current
        if prepared is not None and prepared.committing is not None:
            raise Conflict(
                f"{what} cannot run while prepared NCCL update {prepared.id} is being committed "
                "(the workers wait for its broadcast, at most the group's timeout)"
            )
        if prepared is not None:
            raise Conflict(
                f"{what} cannot run while NCCL update {prepared.id} is prepared; POST "
                "/weights/nccl/commit first (or /weights/nccl/init, which drops it)"
            )

    async def init_group(self, request: NcclInitRequest) -> None:
        """Form the weight-sync group (again): an update prepared on the old group is ended
        first, its commit cancelled if it waits for the old group's broadcast."""
        prepared = self.current
        if prepared is not None and prepared.committing is not None:
            # its workers wait for bytes from the group this init replaces: the learner that
            # would send them restarted (or gave that group up), so they will not come
            cancelled = await self.core.engine.cancel_nccl_commit()
            log.warning("init: %s the commit of prepared NCCL update %s (it waits for a broadcast "
                        "from the previous weight-sync group)",
                        "cancelled" if cancelled else "waiting for", prepared.id)  # fmt: skip
            await prepared.committing.wait()
        if self.current is not None:  # a learner that restarted after preparing
            await self.drop("the weight-sync group is being formed again")
        self.group_timeout_s = request.timeout_s
        await self.core.engine.init_weight_group(request)

    async def prepare(self, request: NcclUpdateRequest, num_bytes: int) -> NcclPrepared:
        """Pause (the generations in flight finish first), have the workers queue the receives,
        and hold the pause until the commit; dropped if not committed in the group's timeout."""
        core = self.core
        prepared = self.current = PreparedUpdate(uuid.uuid4().hex, request, num_bytes)
        try:
            await core.gate.acquire_write()
        except BaseException:
            self.current = None
            raise
        try:
            core.require_weights_awake()
            await core.engine.prepare_nccl_update(request)
        except BaseException:
            self.current = None
            await asyncio.shield(core.gate.release_write())
            raise
        timeout = self.group_timeout_s
        prepared.expiry = asyncio.get_running_loop().call_later(
            timeout, lambda: asyncio.ensure_future(self._expire(prepared))
        )
        return NcclPrepared(prepared_id=prepared.id, num_bytes=num_bytes, expires_s=timeout)

    async def commit(
        self, prepared_id: str, load: Callable[[NcclUpdateRequest, int], Awaitable[T]]
    ) -> T:
        """``load(request, num_bytes)`` the prepared update, the pause still held; it is no
        longer prepared afterwards, and a failed load drops it (and the group)."""
        prepared = self.current
        if prepared is None or prepared.id != prepared_id or prepared.expiry is None:
            raise Conflict(
                f"no prepared NCCL update {prepared_id!r} (a failed commit, an init or "
                "its expiry drops one); prepare the update again"
            )
        if prepared.committing is not None:
            raise Conflict(f"prepared NCCL update {prepared.id} is already being committed")
        prepared.committing = asyncio.Event()
        prepared.expiry.cancel()
        loaded = False
        try:
            result = await load(prepared.request, prepared.num_bytes)
            loaded = True
        except BaseException as exc:
            log.warning("prepared NCCL update %s failed: %s", prepared.id, exc)
            raise
        finally:  # no longer prepared: whoever waits for the commit goes on
            if self.current is prepared:
                self.current = None
            prepared.committing.set()
            # a failed one's receives may still wait: drop them (and the group)
            await self._release(prepared, drop=not loaded)
        return result

    async def _expire(self, prepared: PreparedUpdate) -> None:
        if self.current is prepared and prepared.committing is None:
            await self.drop(f"not committed within {self.group_timeout_s:.0f} s")

    async def drop(self, why: str) -> None:
        """Give a prepared update up: the workers abort the group (ending its receives) and
        generation resumes on the weights it had."""
        prepared, self.current = self.current, None
        if prepared is None:
            return
        log.warning("prepared NCCL update %s dropped (%s); the learner must init the weight-sync "
                    "group again", prepared.id, why)  # fmt: skip
        await self._release(prepared, drop=True)

    async def _release(self, prepared: PreparedUpdate, *, drop: bool) -> None:
        if prepared.expiry is not None:
            prepared.expiry.cancel()
        try:
            if drop:
                await self.core.engine.drop_prepared_update()
        finally:
            await asyncio.shield(self.core.gate.release_write())
