"""``[rollout.sync] type = "file"``: one safetensors file on a disk the learner and every
server share, written under a temporary name and renamed (a server never sees a half-written
file), then loaded by every server."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from learner.sync.base import WeightTransport
from learner.sync.tensors import in_dtype, sync_payload

if TYPE_CHECKING:
    from torch import nn

    from learner.config.sync import FileSyncConfig
    from rollout_server.client import RolloutClient
    from rollout_server.protocol import WeightUpdateResponse

# One name, not one per process: a learner killed mid-write (a sync of a large model takes
# seconds of every step) leaves at most this file, which the next push overwrites; per-process
# names left one full copy of the weights on the shared disk per crash.
FILE_SYNC_TMP = ".weights.safetensors.tmp"


class FileTransport(WeightTransport):
    def __init__(
        self, cfg: FileSyncConfig, client: RolloutClient, *, ready_timeout_s: float
    ) -> None:
        super().__init__(client, ready_timeout_s=ready_timeout_s)
        self.cfg = cfg

    async def connect(self) -> None:
        """Delete what a learner killed mid-write left."""
        (Path(self.cfg.dir) / FILE_SYNC_TMP).unlink(missing_ok=True)

    async def push(
        self, model: nn.Module, version: int | None = None
    ) -> list[WeightUpdateResponse]:
        from safetensors.torch import save_file

        sync_dir = Path(self.cfg.dir)
        sync_dir.mkdir(parents=True, exist_ok=True)
        named, adapter = sync_payload(model, self.cfg.lora)
        final = sync_dir / ("adapter.safetensors" if adapter else "weights.safetensors")
        tmp = sync_dir / FILE_SYNC_TMP
        cast = in_dtype(named, await self.server_dtype())
        tensors = {n: t.contiguous().cpu() for n, t in cast}
        save_file(tensors, str(tmp))
        tmp.replace(final)  # the server never sees a half-written file
        return await self.client.load_weights_file(str(final.resolve()), version, adapter=adapter)
