"""``[rollout.sync] type = "http"``: safetensors buckets in HTTP request bodies. Needs nothing
but the servers' URLs (CPU, tests); the servers stage the buckets and load them all at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from learner.sync.base import WeightTransport
from learner.sync.tensors import in_dtype, sync_payload

if TYPE_CHECKING:
    from torch import nn

    from learner.config.sync import HttpSyncConfig
    from rollout_server.client import RolloutClient
    from rollout_server.protocol import WeightUpdateResponse


class HttpTransport(WeightTransport):
    def __init__(
        self, cfg: HttpSyncConfig, client: RolloutClient, *, ready_timeout_s: float
    ) -> None:
        super().__init__(client, ready_timeout_s=ready_timeout_s)
        self.cfg = cfg

    async def push(
        self, model: nn.Module, version: int | None = None
    ) -> list[WeightUpdateResponse]:
        tensors, adapter = sync_payload(model, self.cfg.lora)
        return await self.client.update_weights(
            in_dtype(tensors, await self.server_dtype()),
            version=version,
            bucket_bytes=self.cfg.bucket_mb << 20,
            adapter=adapter,
        )
