"""``[rollout.sync] type = "vllm"``: the weights over vLLM's own RL interface.

What a stock ``vllm serve --weight-transfer-config '{"backend": ...}'`` speaks, and our server
answers too. The HTTP routes carry the control plane; vLLM's weight-transfer engine carries the
bytes, with the trainer's side of each engine called as vLLM ships it:

- ``nccl``: ``NCCLWeightTransferEngine.trainer_init`` forms one group of the learner (rank 0)
  and every worker of every server (``rank_offset`` after the workers of the servers before it),
  and ``trainer_send_weights`` broadcasts the tensors (packed into buffers with ``packed``);
- ``ipc``: ``IPCWeightTransferEngine.trainer_send_weights`` shares the tensors as CUDA IPC
  handles with a server on the learner's GPU (one learner process);
- ``gloo``: the same protocol as ``nccl`` over torch's gloo on CPU
  (``rollout_server.weight_transfer.gloo``), which our server's transformers engine receives.

A push: ``/pause?mode=wait`` (the generations in flight finish), ``/start_weight_update``,
``/update_weights`` (names, dtypes and shapes; the bytes follow over the engine),
``/finish_weight_update``, ``/resume``. A stock server has no rollback: a push that fails half
way leaves it with some new tensors, so the error is a ``WeightSyncError`` and the learner pushes
again in full (our server loads all of an update at ``finish`` or none of it).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import pickle
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from grpo_common.net import free_port
from grpo_common.threads import run_in_daemon_thread
from learner.run.runtime import SetupError
from learner.sync.base import WeightTransport
from learner.sync.tensors import in_dtype, sync_specs, sync_tensors
from rollout_server.client import RolloutClient, WeightSyncError
from rollout_server.protocol import WeightUpdateResponse

if TYPE_CHECKING:
    from torch import nn

    from learner.config.sync import VllmSyncConfig

log = logging.getLogger(__name__)

#: What vLLM's server says (and must be started with) to unpickle the IPC engine's handles.
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"
# how long close() waits for the group to go (a broadcast in flight may hold it longer)
CLOSE_WAIT_S = 10.0


class VllmNativeTransport(WeightTransport):
    group_bound: ClassVar[bool] = True  # nccl/gloo: the group spans the servers it was formed with

    def __init__(
        self, cfg: VllmSyncConfig, client: RolloutClient, *, device: Any, ready_timeout_s: float
    ) -> None:
        super().__init__(client, ready_timeout_s=ready_timeout_s)
        self.cfg = cfg  # ``device`` unused: vLLM's engines send from the current CUDA device
        self.group: Any = None
        self._servers: list[str] = []

    @property
    def packed(self) -> bool:
        return self.cfg.packed and self.cfg.backend != "gloo"  # gloo sends tensor by tensor

    async def connect(self) -> None:
        """Form the transfer group with every server's workers (nccl, gloo); ipc needs none."""
        if self.cfg.backend == "ipc":
            _one_learner_process()
            _ipc_engine()  # before the first push: a missing dependency is a setup error
            return
        servers = list(self.client.servers)
        sizes = [await self.client.world_size(s) for s in servers]
        info = {
            "master_address": self.cfg.master_address,
            "master_port": self.cfg.master_port or free_port(),
            "world_size": 1 + sum(sizes),
        }
        offsets = [1 + sum(sizes[:i]) for i in range(len(servers))]
        joins = [
            self.client.native(s, "init_weight_transfer_engine",
                               {"init_info": {**info, "rank_offset": off}})
            for s, off in zip(servers, offsets, strict=True)
        ]  # fmt: skip
        trainer = run_in_daemon_thread(self._trainer_init, info)
        done = await asyncio.gather(trainer, *joins, return_exceptions=True)
        if failed := [e for e in done if isinstance(e, BaseException)]:
            raise WeightSyncError(
                ",".join(servers), f"forming the weight-transfer group: {failed[0]}"
            )
        self.group, self._servers = done[0], servers
        log.info(
            "vLLM weight transfer (%s): group of %d formed", self.cfg.backend, info["world_size"]
        )

    def _trainer_init(self, info: dict[str, Any]) -> Any:
        if self.cfg.backend == "gloo":
            from rollout_server.weight_transfer import gloo

            return gloo.trainer_init(info)
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        return NCCLWeightTransferEngine.trainer_init(info)

    def close(self) -> None:
        """Drop the group. Closing it waits for a broadcast still in flight (one no server
        receives ends only at the group's timeout), so it closes on a thread of its own,
        awaited for a few seconds: at the end of a run nothing is in flight and the group is
        gone before the process exits (a Gloo group still being torn down on a daemon thread
        at exit ended the learner with ``terminate called without an active exception``)."""
        if self.group is not None and hasattr(self.group, "close"):
            closing = threading.Thread(
                target=self.group.close, name="close-transfer-group", daemon=True
            )
            closing.start()
            closing.join(timeout=CLOSE_WAIT_S)
        self.group, self._servers = None, []

    async def push(
        self, model: nn.Module, version: int | None = None
    ) -> list[WeightUpdateResponse]:
        if self.cfg.backend != "ipc" and (
            self.group is None or self._servers != self.client.servers
        ):
            self.close()
            await self.connect()
        dtype = await self.server_dtype()
        specs = sync_specs(model, dtype)
        update_info = {
            "names": [s.name for s in specs],
            "dtype_names": [s.dtype for s in specs],
            "shapes": [list(s.shape) for s in specs],
            "packed": self.packed,
        }
        tensors = in_dtype(sync_tensors(model), dtype)
        servers, start = list(self.client.servers), time.perf_counter()
        await self.client.pause("wait")
        try:
            await asyncio.gather(*(self.client.native(s, "start_weight_update",
                                                      {"is_checkpoint_format": True})
                                   for s in servers))  # fmt: skip
            await self._send(servers, update_info, tensors)
            # our server serves ``version`` (a resync keeps the learner's); vLLM ignores it
            at = {"version": version} if version is not None else None
            await asyncio.gather(
                *(self.client.native(s, "finish_weight_update", params=at) for s in servers)
            )
        except Exception as e:
            self.close()  # a broken group is formed again at the next push
            if (setup := refused_pickles(servers, e)) is not None:
                raise setup from e
            raise WeightSyncError(",".join(servers), f"vLLM weight update failed: {e}") from e
        finally:
            await self.client.resume()
        return await self._answers(servers, version, len(specs), time.perf_counter() - start)

    async def _send(self, servers: list[str], update_info: dict[str, Any], tensors: Any) -> None:
        """The update's names to every server while the bytes go over the engine."""
        if self.cfg.backend == "ipc":
            loop = asyncio.get_running_loop()
            await asyncio.to_thread(self._send_ipc, servers, tensors, loop)
            return
        posts = [asyncio.ensure_future(self.client.native(s, "update_weights",
                                                          {"update_info": update_info}))
                 for s in servers]  # fmt: skip
        # on a daemon thread: a broadcast that no server receives (the update was refused)
        # blocks until the group's timeout, and must hold neither the error nor the exit
        send = run_in_daemon_thread(self._broadcast, tensors)
        # A server that refuses the update (400: other shapes) never receives: its error is
        # raised at once, not after a broadcast that would wait for it (NCCL has no timeout)
        done, _ = await asyncio.wait([send, *posts], return_when=asyncio.FIRST_EXCEPTION)
        if failed := [t.exception() for t in done if t.exception() is not None]:
            for post in posts:
                post.cancel()
            raise failed[0]

    def _broadcast(self, tensors: Iterable[tuple[str, Any]]) -> None:
        if self.cfg.backend == "gloo":
            from rollout_server.weight_transfer import gloo

            gloo.trainer_send_weights(tensors, self.group)
            return
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        args = {"group": self.group, "packed": self.packed}
        NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), args)

    def _send_ipc(self, servers: list[str], tensors: Any, loop: asyncio.AbstractEventLoop) -> None:
        """vLLM's IPC sender, its update posted to every server through this client (its
        own ``send_mode="http"`` posts without the API key)."""
        engine = _ipc_engine()

        def post(update_info: Any) -> None:
            fields = {k: v for k, v in vars(update_info).items() if k != "ipc_handles"}
            fields["ipc_handles_pickled"] = base64.b64encode(
                pickle.dumps(update_info.ipc_handles)
            ).decode()
            for s in servers:
                asyncio.run_coroutine_threadsafe(
                    self.client.native(s, "update_weights", {"update_info": fields}), loop
                ).result()

        engine.trainer_send_weights(iter(tensors), {"send_mode": post, "packed": self.packed})

    async def _answers(
        self, servers: list[str], version: int | None, count: int, seconds: float
    ) -> list[WeightUpdateResponse]:
        """What each server serves now: a stock server's version is the client's count (the
        learner's ``version`` where it gives one), our server's its own ``/info``."""
        counts = getattr(self.client, "versions", None)
        out = []
        for s in servers:
            if counts is not None:
                counts[s] = version if version is not None else counts.get(s, 0) + 1
                served = counts[s]
            else:
                served = (await self.client.info_of(s)).weight_version
            out.append(WeightUpdateResponse(weight_version=served, num_tensors=count,
                                            num_bytes=0, seconds=seconds))  # fmt: skip
        return out


def refused_pickles(servers: list[str], e: BaseException) -> SetupError | None:
    """A stock ``vllm serve`` refuses the IPC engine's handles, which travel pickled, unless
    started with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vLLM 0.24 answers 500 naming it, and
    its engine core then stops): a setting to change, not a sync to retry."""
    if INSECURE_SERIALIZATION not in str(e):
        return None
    return SetupError(
        f"{','.join(servers)} refused the CUDA IPC handles of vLLM's IPC engine, which travel "
        f"pickled: start vllm serve with {INSECURE_SERIALIZATION}=1 (and keep it on a private "
        'network), or use type = "ipc" with our server'
    )


def _ipc_engine() -> Any:
    """vLLM's ``IPCWeightTransferEngine``. Its module imports ``ray`` (vLLM 0.24), which a
    plain ``pip install vllm`` does not bring: named here as a setting to change."""
    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    except ModuleNotFoundError as e:
        # the distribution to install: "ray", or "vllm" for any vllm module (none, or too old)
        package = (e.name or "vllm").partition(".")[0]
        raise SetupError(
            f'[rollout.sync] type = "vllm" with backend = "ipc": vLLM\'s IPC engine needs the '
            f"{package!r} package, not installed here (pip install {package}, on the learner and "
            'the server), or use type = "ipc" with our server'
        ) from e
    return IPCWeightTransferEngine


def _one_learner_process() -> None:
    """vLLM's IPC sender all-gathers the handles over every process of torch.distributed's
    default group, which only the learner's main process enters here."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise SetupError(
            '[rollout.sync] type = "vllm" with backend = "ipc" takes one learner process '
            f'(this run has {dist.get_world_size()}): use backend = "nccl", or type = "ipc" '
            "with our server"
        )
