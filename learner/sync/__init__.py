"""Weight sync from the learner to the rollout servers: one protocol
(``learner.sync.base.WeightTransport``), five transports, picked by ``[rollout.sync] type``:

- ``http``: safetensors buckets in request bodies (CPU, tests, no NCCL; ``learner.sync.http``);
- ``file``: one safetensors file on a shared disk, loaded by every server (``learner.sync.file``);
- ``nccl``: flat buckets broadcast from learner rank 0 to the servers' workers
  (``learner.sync.nccl``, GPU only);
- ``ipc``: flat buckets shared as CUDA IPC handles with servers on the learner's own GPU
  (``learner.sync.ipc``, colocated mode);
- ``vllm``: vLLM's own RL routes and weight-transfer engines (nccl, ipc; gloo on CPU), what a
  stock ``vllm serve`` speaks (``learner.sync.vllm_native``).

What they send (the full or LoRA-merged weights, or a LoRA adapter alone over http and file; their
specs, the servers' dtype) is
``learner.sync.tensors``; ZeRO-3's bucketed gathers are ``learner.sync.zero3``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from learner.config.sync import (
    FileSyncConfig,
    HttpSyncConfig,
    IpcSyncConfig,
    NcclSyncConfig,
    VllmSyncConfig,
)

if TYPE_CHECKING:
    from learner.config.rollout import RolloutConfig
    from learner.sync.base import WeightTransport
    from rollout_server.client import RolloutClient


def make_transport(
    rollout: RolloutConfig, client: RolloutClient, *, device: Any = None
) -> WeightTransport:
    """The transport of ``rollout.sync``, speaking to ``client``'s servers; ``device``: the
    learner's (NCCL and IPC send from its GPU). Each is imported only when chosen."""
    sync, wait = rollout.sync, rollout.ready_timeout_s
    match sync:
        case HttpSyncConfig():
            from learner.sync.http import HttpTransport

            return HttpTransport(sync, client, ready_timeout_s=wait)
        case FileSyncConfig():
            from learner.sync.file import FileTransport

            return FileTransport(sync, client, ready_timeout_s=wait)
        case NcclSyncConfig():
            from learner.sync.nccl import NcclTransport

            return NcclTransport(sync, client, device=device, ready_timeout_s=wait)
        case IpcSyncConfig():
            from learner.sync.ipc import IpcTransport

            return IpcTransport(sync, client, device=device, ready_timeout_s=wait)
        case VllmSyncConfig():
            from learner.sync.vllm_native import VllmNativeTransport

            return VllmNativeTransport(sync, client, device=device, ready_timeout_s=wait)
    raise ValueError(f"no weight transport for rollout.sync = {sync!r}")
