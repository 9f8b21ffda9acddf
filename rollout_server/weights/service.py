"""Weight updates over every transport (an HTTP body, staged buckets, a file, NCCL, CUDA IPC)
and the served weights' checksum.

Every update is validated whole before the pause; it loads under the pause gate's write side
(the generations in flight finish first, new ones wait), passes a short generation probe
(``probe.py``) before anything generates with it, and the version moves only once all of it
loaded and passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_server.errors import BadRequest, Conflict, NonFiniteWeights
from rollout_server.protocol import (
    INT64_MAX,
    NcclCommitRequest,
    NcclPrepared,
    WeightChecksum,
    WeightUpdateResponse,
)
from rollout_server.weights.prepared import PreparedUpdates
from rollout_server.weights.probe import load_probed
from rollout_server.weights.staging import WeightStager
from rollout_server.weights.validation import (
    validate_adapter,
    validate_ipc_announce,
    validate_nccl_announce,
    validate_tensors,
)

if TYPE_CHECKING:
    import torch

    from rollout_server.core import ServerCore
    from rollout_server.engine.base import ReceivedUpdate
    from rollout_server.protocol import (
        IpcUpdateRequest,
        LoraAdapterSpec,
        NcclInitRequest,
        NcclUpdateRequest,
    )

log = logging.getLogger(__name__)

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
             "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}  # fmt: skip


T = TypeVar("T")


class WeightsService:
    def __init__(self, core: ServerCore) -> None:
        self.core = core
        self.stager = WeightStager()
        self.prepared = PreparedUpdates(core)

    async def close(self) -> None:
        """Drop a prepared update before the engine closes (its receives hold the group)."""
        if self.core.state == "ready":
            await self.prepared.drop("the server is shutting down")

    # --- versions --------------------------------------------------------------------------

    def _next_version(self, version: int | None) -> int:
        current = self.core.version
        if version is None:
            if current >= INT64_MAX:
                raise Conflict(
                    f"the current weight version {current} is the largest a version may be "
                    f"(int64); there is no next one (restart the server to count again)"
                )
            return current + 1
        if version <= current:
            raise Conflict(
                f"version={version} is not newer than the current weight version {current}; "
                f"send a larger version or omit it to use {current + 1}"
            )
        return version

    def check_update_version(self, version: int | None) -> None:
        """Early refusal (at begin/announce) of a version that could never be committed."""
        self.core.require_weights_awake()
        self.prepared.refuse("another weight update")
        self._next_version(version)

    def _record_update(
        self,
        transport: str,
        num_tensors: int,
        num_bytes: int,
        seconds: float,
        checksum: float | None,
    ) -> WeightUpdateResponse:
        version, m = self.core.version, self.core.metrics
        m.weight_updates.labels(transport, "ok").inc()
        m.weight_update_seconds.observe(seconds)
        m.weight_update_bytes.inc(num_bytes)
        log.info("weights v%d loaded over %s: %d tensors, %.1f MB in %.2fs",
                 version, transport, num_tensors, num_bytes / 1e6, seconds)  # fmt: skip
        return WeightUpdateResponse(
            weight_version=version,
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            seconds=seconds,
            checksum=checksum,
        )

    # --- the probe before a version is served ---------------------------------------------

    async def load_probed(
        self, load: Callable[[], Awaitable[T]], names: Collection[str], *, rollback: bool = True
    ) -> T:
        """``load()`` (under the write gate the caller holds), then the probe:
        ``rollout_server.weights.probe.load_probed``."""
        return await load_probed(self.core, load, names, rollback=rollback)

    # --- tensors sent whole (HTTP, staged buckets, a file) ---------------------------------

    async def apply_weights(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int | None,
        transport: str,
        *,
        values_checked: bool = False,
    ) -> WeightUpdateResponse:
        """Validate, then load under the pause; the version moves only if all of it loaded.
        ``values_checked``: staged buckets were already scanned for NaN/inf on arrival."""
        core = self.core
        core.require_weights_awake()
        num_bytes = await asyncio.to_thread(
            validate_tensors,
            tensors,
            core.engine.weight_metadata(),
            check_values=not values_checked,
        )
        async with core.gate.write():
            core.require_weights_awake()
            self.prepared.refuse("another weight update")
            new_version = self._next_version(version)
            start = time.perf_counter()

            async def load() -> None:
                await core.engine.load_weights(tensors.items())
                await core.engine.reset_prefix_cache()

            await self.load_probed(load, tensors.keys())
            seconds = time.perf_counter() - start
            core.set_version(new_version, tensors)
        return self._record_update(transport, len(tensors), num_bytes, seconds, None)

    async def apply_adapter(
        self,
        spec: LoraAdapterSpec,
        tensors: dict[str, torch.Tensor],
        version: int | None,
        transport: str,
    ) -> WeightUpdateResponse:
        """A LoRA adapter served on the base weights: validated whole against the base model
        (names, shapes, dtypes, finite values) before the pause, then loaded as a new adapter
        under the pause gate's write side, as any update: the generations in flight finish on
        the previous adapter, and the version moves only once the engine switched to this one."""
        core = self.core
        core.require_weights_awake()
        num_bytes = await asyncio.to_thread(
            validate_adapter, tensors, spec, core.engine.weight_metadata()
        )
        async with core.gate.write():
            core.require_weights_awake()
            self.prepared.refuse("another weight update")
            new_version = self._next_version(version)
            start = time.perf_counter()

            async def load() -> None:
                await core.engine.load_adapter(spec, tensors, new_version)
                await core.engine.reset_prefix_cache()

            await self.load_probed(load, (), rollback=False)
            seconds = time.perf_counter() - start
            core.set_version(new_version, ())  # the base weights are as they were
        return self._record_update(transport, len(tensors), num_bytes, seconds, None)

    async def weights_checksum(self) -> WeightChecksum:
        """The served weights' checksum, between loads (never of half-loaded weights)."""
        core = self.core
        core.require_weights_awake()
        async with core.gate.read():
            core.require_weights_awake()
            version, checksum = core.version, await core.engine.weights_checksum()
        if not math.isfinite(checksum):  # JSON has no NaN/inf: it would go out as null
            raise NonFiniteWeights(
                f"the served weights (version {version}) hold non-finite values (NaN or inf), "
                "so they have no checksum: they came with the checkpoint the server started from "
                "(updates holding them are refused); load finite weights"
            )
        return WeightChecksum(weight_version=version, checksum=checksum)

    # --- announced updates (NCCL, CUDA IPC) ------------------------------------------------

    async def init_weight_group(self, request: NcclInitRequest) -> None:
        self.core.require_loaded()
        await self.prepared.init_group(request)

    async def nccl_prepare(self, request: NcclUpdateRequest) -> NcclPrepared:
        """Pause early: wait for the generations in flight, then have the workers queue the
        update's receives and reset the prefix cache, and hold the pause (new generations wait,
        as behind any load) until the commit, which then only waits for the bytes and loads.
        Dropped (and the pause lifted) if not committed within the group's timeout."""
        self.prepared.refuse("preparing another update")
        if request.adapter is not None:
            raise BadRequest(
                "a LoRA adapter update is not prepared: announce it with POST /weights/nccl/update"
            )
        num_bytes = self._check_announce(validate_nccl_announce, request)
        return await self.prepared.prepare(request, num_bytes)

    async def nccl_commit(self, request: NcclCommitRequest) -> WeightUpdateResponse:
        """Load the prepared update once its broadcast arrived; the version moves only if all of
        it loaded. A failed commit drops it (and the group: init again). The learner may post
        the commit before it broadcasts (right after preparing): the workers then wait for the
        bytes, at most the group's timeout, and other updates and sleep stay refused."""
        announced = time.time()

        def load(prepared: NcclUpdateRequest, num_bytes: int) -> Awaitable[WeightUpdateResponse]:
            receive = self.core.engine.commit_nccl_update
            return self._announced_update(
                announced, prepared, num_bytes, "nccl", receive, gate_held=True
            )

        return await self.prepared.commit(request.prepared_id, load)

    async def nccl_update(self, request: NcclUpdateRequest) -> WeightUpdateResponse:
        announced = time.time()
        num_bytes = self._check_announce(validate_nccl_announce, request)
        return await self._announced_update(
            announced, request, num_bytes, "nccl", self.core.engine.receive_nccl_update
        )

    async def ipc_update(self, request: IpcUpdateRequest) -> WeightUpdateResponse:
        """Colocated sync: the buckets are CUDA IPC handles to the learner's GPU memory."""
        announced = time.time()
        num_bytes = self._check_announce(validate_ipc_announce, request)
        return await self._announced_update(
            announced, request, num_bytes, "ipc", self.core.engine.receive_ipc_update
        )

    def _check_announce(self, validate: Callable[..., int], request: NcclUpdateRequest) -> int:
        """Refuse early (4xx, nothing paused) what could never load; returns its bytes."""
        self.core.require_weights_awake()
        self.prepared.refuse("another weight update")
        num_bytes = validate(request, self.core.engine.weight_metadata(), _ITEMSIZE)
        if request.adapter is not None:
            self.core.engine.check_adapter(request.adapter)
        self._next_version(request.version)
        return num_bytes

    async def _announced_update(
        self,
        announced: float,
        request: NcclUpdateRequest,
        num_bytes: int,
        transport: str,
        receive: Callable[[Any], Awaitable[ReceivedUpdate]],
        *,
        gate_held: bool = False,
    ) -> WeightUpdateResponse:
        """Receive and load under the write gate (``gate_held``: taken since prepare); the
        version moves only once all loaded."""
        core = self.core
        async with contextlib.nullcontext() if gate_held else core.gate.write():
            paused = {} if gate_held else {"paused": time.time()}
            core.require_weights_awake()
            new_version = self._next_version(request.version)
            start = time.perf_counter()
            # an adapter leaves the base weights as they were
            changed = () if request.adapter is not None else [t.name for t in request.tensors]

            async def load() -> ReceivedUpdate:
                got = await receive(request)
                if not got.prefix_cache_reset:
                    await core.engine.reset_prefix_cache()
                return got

            # received straight into the served weights: the engine keeps no copy to restore
            got = await self.load_probed(load, changed, rollback=False)
            seconds = time.perf_counter() - start
            core.set_version(new_version, changed)
        response = self._record_update(
            transport, len(request.tensors), num_bytes, seconds, got.checksum
        )
        timeline = {"announced": announced, **paused, **got.timeline, "answered": time.time()}
        return response.model_copy(
            update=dict(
                received_s=got.received_s,
                loaded_s=got.loaded_s,
                loader=got.loader,
                timeline=timeline,
            )
        )
