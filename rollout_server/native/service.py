"""vLLM's RL weight-transfer interface on this server: pause/resume, and a trainer's update as
init -> start -> update_weights (one or more) -> finish.

On the transformers engine the tensors come over Gloo (``rollout_server.weight_transfer.gloo``,
the CPU twin of vLLM's NCCL engine) and are staged: ``finish`` applies them all at once through
``WeightsService.apply_weights`` (validated whole, NaN/inf refused, loaded under the pause gate,
the version moves by one only if all of it loaded). A receive that fails drops what was staged
and the group; the served weights and version stay as they were. On the vLLM engine started with
``--weight-transfer-backend``, each step is vLLM's own (its workers load as the bytes arrive) and
the version moves at finish.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

from rollout_server.errors import BadRequest, Conflict, ServiceError, format_validation_errors
from rollout_server.protocol import WeightTransferInitInfo, WeightTransferUpdateInfo

if TYPE_CHECKING:
    import torch

    from rollout_server.core import ServerCore
    from rollout_server.weight_transfer.gloo import GlooGroup
    from rollout_server.weights.service import WeightsService

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
# the dtypes a sender may announce; a tensor is cast to the parameter's dtype on arrival
KNOWN_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})


class TransferFailed(ServiceError):
    """The trainer's side did not deliver (it died, closed the group, or timed out)."""

    status_code = 502


def parse(model: type[BaseModel], value: dict[str, Any], field: str) -> Any:
    """``value`` as ``model``, or a 400 naming the field (``update_info.names: ...``)."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = [{**e, "loc": (field, *e["loc"])} for e in exc.errors()]
        raise BadRequest(format_validation_errors(errors)) from exc


class NativeService:
    def __init__(self, core: ServerCore, weights: WeightsService) -> None:
        self.core = core
        self.weights = weights
        self._group: GlooGroup | None = None
        self._open = False  # between start and finish
        self._names: set[str] = set()  # announced since start (the vLLM engine's update)
        self._staged: dict[str, torch.Tensor] = {}
        self._busy = asyncio.Lock()  # one init / receive / finish at a time

    @property
    def delegated(self) -> bool:
        """The vLLM engine: each step goes to vLLM's own weight-transfer engine."""
        return self.core.engine.name == "vllm"

    def backend(self) -> str | None:
        """What ``/info`` advertises as ``weight_transfer_backend``."""
        if self.core.settings.disable_admin_endpoints:
            return None
        return self.core.settings.weight_transfer_backend if self.delegated else "gloo"

    # --- pause ----------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        """New generations wait until ``resume``. ``abort`` cancels the generations in flight
        (each answers 503, to be sent again); ``wait`` and ``keep`` let them finish (``keep``
        cannot freeze them mid-decode here). Returns once none is in flight."""
        self.core.require_loaded()
        await self.core.gate.hold(wait=True, abort=mode == "abort")
        log.info("generation paused (mode=%s)", mode)

    async def resume(self) -> None:
        await self.core.gate.release_hold()

    def is_paused(self) -> bool:
        return self.core.gate.held

    def world_size(self, include_dp: bool) -> int:
        self.core.require_loaded()
        return self.core.engine.world_size(include_dp) if self.delegated else 1  # type: ignore[attr-defined]

    # --- the update -----------------------------------------------------------------------

    def _refuse_busy(self, what: str) -> None:
        if self._busy.locked():
            raise Conflict(f"{what}: another weight-transfer step is in progress; retry after it")

    async def init(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's group (closing any previous one and dropping an open update);
        returns once every rank joined."""
        core = self.core
        core.require_loaded()
        if self.delegated:
            await core.engine.init_weight_transfer_engine(init_info)  # type: ignore[attr-defined]
            return
        info = parse(WeightTransferInitInfo, init_info, "init_info")
        if info.rank_offset >= info.world_size:
            raise BadRequest(
                f"init_info.rank_offset={info.rank_offset} leaves no rank for this server's "
                f"worker in world_size={info.world_size}"
            )
        self._refuse_busy("init_weight_transfer_engine")
        async with self._busy:
            self._drop("a new weight-transfer group was initialized")
            self._group = await self._join(info)

    async def _join(self, info: WeightTransferInitInfo) -> GlooGroup:
        """Join the group within ``info.timeout_s``, however the peer behaves (one that never
        answers included): the join runs on a thread of its own, abandoned at the deadline,
        so the server goes on serving while it waits and answers in time."""
        from rollout_server.weight_transfer.gloo import abandon, receiver_join

        where = f"{info.master_address}:{info.master_port}"
        joining = receiver_join(info.model_dump(), info.rank_offset, info.timeout_s)
        waiting = asyncio.wrap_future(joining)
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # read when abandoned
        try:
            await asyncio.wait_for(asyncio.shield(waiting), info.timeout_s)
        except TimeoutError:
            group = abandon(joining, f"no answer within {info.timeout_s:g} s")
            if group is not None:  # it joined as the deadline passed
                return group
            raise TransferFailed(
                f"could not join the trainer's gloo group at {where} within "
                f"init_info.timeout_s={info.timeout_s:g} s: the trainer did not complete the "
                "rendezvous (is it calling its own init at the same time, on that address?)"
            ) from None
        except asyncio.CancelledError:
            abandon(joining, "the request was cancelled")
            raise
        except Exception as exc:
            raise TransferFailed(
                f"could not join the trainer's gloo group at {where} within "
                f"init_info.timeout_s={info.timeout_s:g} s: {exc}"
            ) from exc
        return joining.result()

    async def start(self, is_checkpoint_format: bool) -> None:
        core = self.core
        if self._open:
            raise Conflict("a weight update is already open: POST /finish_weight_update first")
        self._refuse_busy("start_weight_update")
        self.weights.check_update_version(None)  # awake, no NCCL update prepared, version left
        if self.delegated:
            await core.engine.start_weight_update(is_checkpoint_format)  # type: ignore[attr-defined]
        elif self._group is None:
            raise Conflict("no weight-transfer group: POST /init_weight_transfer_engine first")
        self._open, self._names, self._staged = True, set(), {}

    async def update(self, update_info: dict[str, Any]) -> None:
        """Receive the announced tensors (validated before anything is received) and stage
        them; nothing is served until ``finish``."""
        if not self._open:
            raise Conflict("no weight update is open: POST /start_weight_update first")
        self._refuse_busy("update_weights")
        if self.delegated:
            async with self._busy:
                await self.core.engine.update_weights(update_info)  # type: ignore[attr-defined]
                self._names.update(str(n) for n in update_info.get("names") or ())
            return
        info = parse(WeightTransferUpdateInfo, update_info, "update_info")
        targets = self._check(info)
        group = self._group
        assert group is not None  # start refused an update without a group
        received: dict[str, torch.Tensor] = {}

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in pairs:
                received[name] = tensor.to(targets[name])

        from rollout_server.weight_transfer.gloo import receive_weights

        async with self._busy:
            receiving = asyncio.ensure_future(
                asyncio.to_thread(receive_weights, info.model_dump(), group, load)
            )
            try:
                await asyncio.shield(receiving)
            except BaseException as exc:
                self._drop(f"the receive failed ({type(exc).__name__}: {exc})")
                if isinstance(exc, Exception):
                    raise TransferFailed(
                        f"receiving the update failed, the staged tensors were dropped and the "
                        f"served weights (version {self.core.version}) are unchanged: {exc}; "
                        "POST /init_weight_transfer_engine again"
                    ) from exc
                raise
            self._staged.update(received)

    def _check(self, info: WeightTransferUpdateInfo) -> dict[str, torch.dtype]:
        """Every announced tensor a parameter of the served model with its shape and a known
        dtype; returns each name's target dtype (the parameter's)."""
        import torch

        if info.packed or info.update_kind != "dense" or info.num_updates_list is not None:
            raise BadRequest(
                "update_info: packed and sparse updates are not supported by this server's gloo "
                "backend; send packed=false, update_kind='dense'"
            )
        n = len(info.names)
        for field in ("dtype_names", "shapes"):
            if len(getattr(info, field)) != n:
                raise BadRequest(
                    f"update_info.{field} has {len(getattr(info, field))} entries for {n} names"
                )
        metadata = self.core.engine.weight_metadata()
        if n > len(metadata):
            raise BadRequest(
                f"update_info.names has {n} entries, the model {len(metadata)} tensors"
            )
        targets: dict[str, torch.dtype] = {}
        for i, (name, dtype, shape) in enumerate(
            zip(info.names, info.dtype_names, info.shapes, strict=True)
        ):
            meta = metadata.get(name)
            if meta is None:
                raise BadRequest(
                    f"update_info.names[{i}]: {name!r} is not a parameter of the model"
                )
            if name in targets:
                raise BadRequest(f"update_info.names[{i}]: {name!r} is announced twice")
            if dtype not in KNOWN_DTYPES:
                raise BadRequest(
                    f"update_info.dtype_names[{i}]: {dtype!r} for {name!r} is not one of "
                    f"{sorted(KNOWN_DTYPES)}"
                )
            if tuple(shape) != tuple(meta.shape):
                raise BadRequest(
                    f"update_info.shapes[{i}]: {name!r} has shape {list(shape)}, the model's is "
                    f"{list(meta.shape)}"
                )
            targets[name] = getattr(torch, meta.dtype)
        return targets

    async def finish(self, version: int | None = None) -> None:
        """Apply what was staged, all at once, as ``version`` (default: the next one). A finish
        with nothing received closes the update and leaves the version as it is."""
        core = self.core
        if not self._open:
            raise Conflict("no weight update is open: POST /start_weight_update first")
        self._refuse_busy("finish_weight_update")
        if version is not None and version <= core.version:
            raise Conflict(
                f"version={version} is not newer than the current weight version "
                f"{core.version}; send a larger version or omit it"
            )
        async with self._busy:
            staged, names = self._staged, self._names
            self._open, self._staged, self._names = False, {}, set()
            if self.delegated:
                async with core.gate.write():
                    finish = core.engine.finish_weight_update  # type: ignore[attr-defined]
                    # vLLM's workers loaded as the bytes came: no copy to go back to
                    await self.weights.load_probed(finish, names, rollback=False)
                    core.set_version(core.version + 1 if version is None else version, names)
                return
            if staged:
                await self.weights.apply_weights(staged, version, transport="gloo")

    def _drop(self, why: str) -> None:
        """Close the group and discard an open update (nothing of it was served)."""
        if self._open:
            log.warning("weight update dropped: %s", why)
        self._open, self._staged, self._names = False, {}, set()
        group, self._group = self._group, None
        if group is not None:
            group.close()

    def close(self) -> None:
        self._drop("the server is shutting down")
