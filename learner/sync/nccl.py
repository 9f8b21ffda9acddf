"""``[rollout.sync] type = "nccl"``: flat buckets broadcast from learner rank 0 to the servers'
workers on other GPUs (``learner.sync.nccl_sender``), the next sync prepared while the learner
trains (``prepare``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo_common.net import free_port
from learner.sync.base import WeightTransport
from learner.sync.nccl_sender import NcclWeightSender
from learner.sync.tensors import announced_payload, sync_specs

if TYPE_CHECKING:
    from torch import nn

    from learner.config.sync import NcclSyncConfig
    from rollout_server.client import RolloutClient
    from rollout_server.protocol import WeightUpdateResponse


class NcclTransport(WeightTransport):
    # A failed push aborts the group: pushing again would have to form it again first.
    retries_pushes = False
    group_bound = True

    def __init__(
        self,
        cfg: NcclSyncConfig,
        client: RolloutClient,
        *,
        device: Any,
        ready_timeout_s: float,
    ) -> None:
        super().__init__(client, ready_timeout_s=ready_timeout_s)
        self.cfg = cfg
        self.device = device
        self._sender: NcclWeightSender | None = None

    async def _joined(self) -> NcclWeightSender:
        if self._sender is None:
            await self.server_dtype()
            sender = NcclWeightSender()
            await sender.init(
                self.client,
                master_address=self.cfg.master_address,
                master_port=self.cfg.master_port or free_port(),
                device=self.device,
            )
            self._sender = sender
        return self._sender

    async def connect(self) -> None:
        """Form the weight-sync group now rather than at the first sync. A new group also ends
        whatever a previous run of this learner left prepared or committing on the servers (a
        crash after preparing), which would otherwise hold their generation paused until the
        group's timeout."""
        await self._joined()

    async def prepare(self, model: nn.Module) -> bool:
        """Have the servers queue the next ``push``'s receives now (they hold generation paused
        until it). Call it while the learner trains and nothing is asked of the servers. An
        adapter sync (MBs) is never prepared."""
        if self.cfg.lora == "adapter":
            return False
        sender = await self._joined()
        return await sender.prepare(
            sync_specs(model, await self.server_dtype()), bucket_bytes=self.cfg.bucket_mb << 20
        )

    async def push(
        self, model: nn.Module, version: int | None = None
    ) -> list[WeightUpdateResponse]:
        sender = await self._joined()
        specs, tensors, adapter = announced_payload(model, self.cfg.lora, await self.server_dtype())
        responses = await sender.send(
            specs, tensors, bucket_bytes=self.cfg.bucket_mb << 20, version=version, adapter=adapter
        )
        assert responses is not None  # send waits for the answers unless told otherwise
        return responses

    @property
    def last_stats(self) -> dict[str, Any]:
        return {} if self._sender is None else dict(self._sender.last_stats)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
