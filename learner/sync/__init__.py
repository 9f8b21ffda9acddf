"""Weight sync from the learner to the rollout servers: one protocol, three transports.

- ``http``: safetensors buckets in request bodies (CPU, tests, no NCCL);
- ``file``: one safetensors file on a shared disk, loaded by every server;
- ``nccl``: flat buckets broadcast from learner rank 0 to the servers' workers
  (``learner.sync.nccl``, GPU only).

Every transport is atomic on the server side: the version moves only once every tensor loaded.
Only the main process talks to the servers; under ZeRO-3 every rank takes part in the gathers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from learner.config import RolloutConfig
    from rollout_server.client import RolloutClient
    from rollout_server.protocol import WeightUpdateResponse


def named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF model's parameters under the names its ``from_pretrained`` checkpoint uses."""
    for name, p in model.named_parameters():
        yield name, p.detach()


async def sync_weights(
    cfg: RolloutConfig, client: RolloutClient, model: nn.Module, run_dir: Path
) -> list[WeightUpdateResponse]:
    """Push ``model``'s weights to every server (main process only, no ZeRO-3 partitioning)."""
    if cfg.sync == "http":
        return await client.update_weights(named_weights(model), bucket_bytes=cfg.bucket_mb << 20)
    if cfg.sync == "file":
        from safetensors.torch import save_file

        assert cfg.sync_dir is not None  # the config validator guarantees it
        sync_dir = Path(cfg.sync_dir)
        sync_dir.mkdir(parents=True, exist_ok=True)
        final = sync_dir / "weights.safetensors"
        tmp = sync_dir / f".weights.{os.getpid()}.tmp"
        save_file({n: t.contiguous().cpu() for n, t in named_weights(model)}, str(tmp))
        tmp.replace(final)
        return await client.load_weights_file(str(final.resolve()))
    raise ValueError(
        f"rollout.sync = {cfg.sync!r} needs the GPU path (learner.sync.nccl); use 'http' or 'file'"
    )
