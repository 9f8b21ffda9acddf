"""The vLLM engine's announced weight updates, NCCL and CUDA IPC: the workers' ``grpo_*`` RPCs
(``vllm_worker``) in order, a prepared NCCL update's cancel flag, and the workers' answers turned
into one ``ReceivedUpdate``. ``VLLMEngine`` holds one ``AnnouncedUpdates``; vLLM itself is only
reached through the callables it is given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from rollout_server.engine.base import EngineError, ReceivedUpdate, WeightsError
from rollout_server.finite import NON_FINITE_REFUSED

if TYPE_CHECKING:
    from rollout_server.nccl_wire import CancelFlag
    from rollout_server.protocol import IpcUpdateRequest, NcclUpdateRequest

log = logging.getLogger(__name__)

Rpc = Callable[..., Awaitable[list[Any]]]


def begin_update_args(
    request: NcclUpdateRequest,
    direct: bool,
    prepared: bool,
    cancel_path: str | None = None,
    adapter_dir: str | None = None,
) -> tuple[Any, ...]:
    """``grpo_begin_update``'s arguments after the specs, in its order. ``adapter_dir``: the
    update is a LoRA adapter, written there (never copied into the parameters)."""
    segment = request.segment_bytes
    return (
        request.buckets,
        request.bucket_dtypes,
        request.checksum,
        direct and adapter_dir is None,
        segment,
        prepared,
        request.ack,
        cancel_path,
        adapter_dir,
    )


class AnnouncedUpdates:
    """``rpc(method, *args)`` runs a method on every worker; ``paused()`` is vLLM's own pause
    around a load; ``direct``: copy into the parameters once a copy plan is verified."""

    def __init__(
        self,
        rpc: Rpc,
        paused: Callable[[], AbstractAsyncContextManager[None]],
        reset_prefix_cache: Callable[[], Awaitable[None]],
        direct: bool,
    ) -> None:
        self._rpc = rpc
        self._paused = paused
        self._reset_prefix_cache = reset_prefix_cache
        self._direct = direct
        self._cancel: CancelFlag | None = None  # the prepared update's, if any

    async def receive_nccl(
        self, request: NcclUpdateRequest, adapter_dir: str | None = None
    ) -> ReceivedUpdate:
        """The workers queue every receive (``grpo_begin_update``); while the bytes arrive the
        prefix cache is reset (vLLM walks every KV block: milliseconds); then the workers
        wait and load (``grpo_finish_update``), or with ``adapter_dir`` write the adapter
        there."""

        async def receive(specs: list[dict[str, Any]], timeline: dict[str, float]) -> list[Any]:
            queued = begin_update_args(request, self._direct, False, None, adapter_dir)
            begun = await self._rpc("grpo_begin_update", specs, *queued)
            timeline["worker_begin"] = min(begun)
            timeline["queued"] = time.time()
            return await self._reset_then_finish(timeline)

        return await self._receive("NCCL", request, receive, prefix_cache_reset=True)

    async def prepare_nccl(self, request: NcclUpdateRequest) -> None:
        """Called paused, and the pause holds until the commit: the prefix cache is reset now
        (no generation can fill it before the load), off the commit's critical path."""
        from rollout_server.nccl_wire import CancelFlag

        specs = [t.model_dump() for t in request.tensors]
        self._forget_cancel()
        self._cancel = CancelFlag.new()  # the workers read its file while they wait
        try:
            queued = begin_update_args(request, self._direct, True, self._cancel.path)
            await self._rpc("grpo_begin_update", specs, *queued)
        except Exception as exc:
            self._forget_cancel()
            raise EngineError(f"could not prepare the NCCL update: {exc}") from exc
        try:
            await self._reset_prefix_cache()
        except BaseException:
            await self.drop_prepared()
            raise

    async def commit_nccl(self, request: NcclUpdateRequest) -> ReceivedUpdate:
        async def finish(_: list[dict[str, Any]], timeline: dict[str, float]) -> list[Any]:
            results = await self._rpc("grpo_finish_update")
            timeline["finished"] = time.time()
            return results

        # the prefix cache was reset at prepare, with generation paused since
        try:
            return await self._receive("NCCL", request, finish, prefix_cache_reset=True)
        finally:
            self._forget_cancel()

    def cancel_commit(self) -> bool:
        """Raise the prepared update's ``CancelFlag``: the workers stop waiting for its bytes
        (within ~10 ms), abort the group, restore what they had copied in, and the commit
        fails. Out of band, as the workers are busy in the commit's RPC."""
        if self._cancel is None:
            return False
        self._cancel.set()
        return True

    def _forget_cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.remove()
            self._cancel = None

    async def drop_prepared(self) -> None:
        try:
            await self._rpc("grpo_drop_prepared")
        finally:
            self._forget_cancel()

    async def _reset_then_finish(self, timeline: dict[str, float]) -> list[Any]:
        """Reset the prefix cache, then wait for the queued receives and load. Both go to the
        engine core back to back (it runs them in order), so the reset overlaps the wire."""
        reset = asyncio.ensure_future(self._reset_prefix_cache())
        await asyncio.sleep(0)  # let the reset go out first
        try:
            results = await self._rpc("grpo_finish_update")
        finally:
            await asyncio.wait([reset])
        timeline["finished"] = time.time()
        reset.result()  # raises if the reset failed
        return results

    async def receive_ipc(
        self, request: IpcUpdateRequest, adapter_dir: str | None = None
    ) -> ReceivedUpdate:
        """The workers load from the learner's CUDA IPC buckets, or with ``adapter_dir`` write
        the adapter there."""
        handles = [h.model_dump() for h in request.handles]

        async def receive(specs: list[dict[str, Any]], timeline: dict[str, float]) -> list[Any]:
            args = (request.buckets, request.bucket_dtypes, request.checksum, handles)
            direct = self._direct and adapter_dir is None
            results = await self._rpc(
                "grpo_receive_ipc", specs, *args, request.gpu_uuid, direct, adapter_dir
            )
            timeline["finished"] = time.time()
            return results

        return await self._receive("CUDA IPC", request, receive, prefix_cache_reset=False)

    async def _receive(
        self,
        transport: str,
        request: NcclUpdateRequest,
        receive: Callable[[list[dict[str, Any]], dict[str, float]], Awaitable[list[Any]]],
        *,
        prefix_cache_reset: bool,
    ) -> ReceivedUpdate:
        """One announced update through the workers (``receive``), under vLLM's pause."""
        specs = [t.model_dump() for t in request.tensors]
        start = time.perf_counter()
        timeline = {"engine": time.time()}
        try:
            async with self._paused():
                results = await receive(specs, timeline)
        except Exception as exc:
            if NON_FINITE_REFUSED in str(exc):  # the worker's WeightsError, through vLLM's RPC
                message = str(exc)[str(exc).index(NON_FINITE_REFUSED) :].split("\n")[0]
                raise WeightsError(
                    f"{transport} weight update refused, the previous weights still serve: "
                    f"{message}"
                ) from exc
            raise EngineError(
                f"{transport} weight update failed, the previous weights still serve: {exc}"
            ) from exc
        first = results[0]
        log.info(
            "%s update: %d tensors received in %.4fs, loaded in %.4fs (%s, staged on %s), "
            "%.4fs in all",
            transport,
            len(specs),
            first["received_s"],
            first["loaded_s"],
            first["loader"],
            first["staged_on"],
            time.perf_counter() - start,
        )
        sums = {r["checksum"] for r in results}
        if len(sums) > 1:
            raise EngineError(f"workers received different bytes (checksums {sorted(sums)})")
        return ReceivedUpdate(
            checksum=first["checksum"],
            received_s=max(r["received_s"] for r in results),
            loaded_s=max(r["loaded_s"] for r in results),
            loader=first["loader"],
            prefix_cache_reset=prefix_cache_reset,
            timeline={**timeline, **first.get("timeline", {})},
        )
