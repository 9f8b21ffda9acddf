"""``[rollout.sync] type = "ipc"``: the colocated learner shares its packed weights with the
server over CUDA IPC.

For a rollout server on the learner's own GPU (``rollout.sync = "ipc"``, colocated mode), where
NCCL cannot join two ranks on one device and the host round trip of ``http``/``file`` costs a
second or more per GB. The main process packs the weights (cast to the server's dtype) into flat
GPU buckets, shares each as a CUDA IPC handle (``rollout_server.cuda_ipc``) in one HTTP call per
server, and frees the buckets once every server answered: the server's workers load straight
from this process's memory, and the update is all-or-nothing like every other transport.

The buckets of one update exist at once (the server loads them together, so a failed update
loads nothing): the transient cost is one copy of the weights in the server's dtype. Under
ZeRO-3 the gathers run bucket by bucket as for NCCL; the other ranks exhaust the same iterator.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from learner.sync.base import WeightTransport
from learner.sync.nccl_buckets import (
    announce_to_all,
    check_checksums,
    drain,
    fill_bucket,
    plan_buckets,
    update_stats,
)
from learner.sync.tensors import announced_payload
from rollout_server.client import RolloutClient
from rollout_server.nccl_wire import bucket_layout
from rollout_server.protocol import (
    IpcUpdateRequest,
    LoraAdapterSpec,
    TensorSpec,
    WeightUpdateResponse,
)
from rollout_server.weight_digest import flat_checksum

if TYPE_CHECKING:
    import torch
    from torch import nn

    from learner.config.sync import IpcSyncConfig

log = logging.getLogger(__name__)


class IpcWeightSender:
    """Shares packed weights with rollout servers on this process's GPU."""

    def __init__(self, client: RolloutClient, device: torch.device | int | str) -> None:
        from learner.sync.tensors import learner_cuda_device

        self.client = client
        self.device = learner_cuda_device(
            device, "ipc", "a CUDA GPU shared with the rollout server"
        )
        self.last_stats: dict[str, float] = {}

    async def send(
        self,
        specs: Sequence[TensorSpec],
        tensor_iter: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = 1 << 30,
        version: int | None = None,
        checksum: bool = False,
        adapter: LoraAdapterSpec | None = None,
    ) -> list[WeightUpdateResponse]:
        """One update; ``tensor_iter`` yields the tensors of ``specs`` in order (consumed to
        the end even on failure, so ZeRO-3 ranks stay in step). Raises ``WeightSyncError`` if
        a server did not load it (it keeps its previous weights). ``adapter``: the tensors are
        that LoRA adapter's, served on the base weights."""
        import torch

        from rollout_server.cuda_ipc import gpu_uuid, share

        specs = list(specs)
        plan = plan_buckets(specs, bucket_bytes)
        layout = bucket_layout([s.model_dump() for s in specs], plan.buckets, plan.dtypes)
        start = time.perf_counter()
        it = iter(tensor_iter)
        flats: list[torch.Tensor] = []
        try:
            with torch.cuda.device(self.device):
                for bucket in layout:
                    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
                    fill_bucket(flat, bucket, it)
                    flats.append(flat)
                if next(it, None) is not None:
                    raise ValueError(
                        "the tensor stream yielded more tensors than the specs announce"
                    )
                torch.cuda.current_stream(self.device).synchronize()
                total = (
                    float(sum(flat_checksum(f, b) for b, f in enumerate(flats)))
                    if checksum
                    else 0.0
                )
                request = IpcUpdateRequest(
                    tensors=specs,
                    buckets=plan.buckets,
                    bucket_dtypes=plan.dtypes,
                    version=version,
                    checksum=checksum,
                    handles=[share(f) for f in flats],
                    gpu_uuid=gpu_uuid(self.device),
                    adapter=adapter,
                )
        except BaseException:
            drain(it, quiet=True)
            raise
        packed_s = time.perf_counter() - start
        try:
            responses = await self._announce(request)
        finally:
            del flats, request  # the servers answered: they no longer map our buffers
            torch.cuda.ipc_collect()
        self.last_stats = update_stats(start, specs, packed_s=packed_s)
        if checksum:
            check_checksums(self.client.servers, responses, total)
        return responses

    async def _announce(self, request: IpcUpdateRequest) -> list[WeightUpdateResponse]:
        # Every server answers before the buffers go (none may still be reading them).
        return await announce_to_all(
            self.client.servers,
            lambda s: self.client.ipc_update(s, request),
            "CUDA IPC",
            wait_for_all=True,
        )


class IpcTransport(WeightTransport):
    """``[rollout.sync] type = "ipc"``: the packed weights shared with the servers on this
    process's GPU (colocated mode)."""

    def __init__(
        self,
        cfg: IpcSyncConfig,
        client: RolloutClient,
        *,
        device: Any,
        ready_timeout_s: float,
    ) -> None:
        super().__init__(client, ready_timeout_s=ready_timeout_s)
        self.cfg = cfg
        self.device = device
        self._sender: IpcWeightSender | None = None

    async def push(
        self, model: nn.Module, version: int | None = None
    ) -> list[WeightUpdateResponse]:
        if self._sender is None:
            self._sender = IpcWeightSender(self.client, self.device)  # refuses without a GPU
        specs, tensors, adapter = announced_payload(model, self.cfg.lora, await self.server_dtype())
        return await self._sender.send(
            specs, tensors, bucket_bytes=self.cfg.bucket_mb << 20, version=version, adapter=adapter
        )

    @property
    def last_stats(self) -> dict[str, Any]:
        return {} if self._sender is None else dict(self._sender.last_stats)
