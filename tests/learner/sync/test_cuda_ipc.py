"""The CUDA IPC transport's CPU-checkable parts: clear refusals without a GPU, the learner's
config switch, and the wire model. Sharing and loading run on the GPU machine
(tests/gpu/test_ipc_sync.py)."""

from __future__ import annotations

import pytest
import torch

from learner.config.rollout import RolloutConfig
from rollout_server.client import RolloutClient
from rollout_server.cuda_ipc import IpcError, local_device, open_handle, share
from rollout_server.protocol import IpcHandle, IpcUpdateRequest

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusals")


def _handle(**kw) -> IpcHandle:
    fields = dict(dtype="bfloat16", numel=8, handle="AAAA", storage_bytes=16, ref_counter_handle="")
    return IpcHandle(**(fields | kw))


def test_share_refuses_what_is_not_a_flat_cuda_tensor() -> None:
    with pytest.raises(ValueError, match="contiguous 1-D CUDA tensor"):
        share(torch.zeros(4))


@needs_no_gpu
def test_open_and_device_lookup_fail_with_what_to_do() -> None:
    with pytest.raises(IpcError, match="same GPU; use sync = 'nccl'"):
        local_device("GPU-1234")
    with pytest.raises(IpcError, match="learner process must be alive"):
        open_handle(_handle(), 0)
    with pytest.raises(IpcError, match="could not open"):
        open_handle(_handle(handle="not base64!"), 0)
    with pytest.raises(IpcError, match="unknown dtype 'bfloat17'"):
        open_handle(_handle(dtype="bfloat17"), 0)


@needs_no_gpu
def test_the_sender_needs_a_gpu() -> None:
    from learner.sync.ipc import IpcWeightSender

    client = RolloutClient(["http://127.0.0.1:9"])
    with pytest.raises(RuntimeError, match="needs a CUDA GPU shared with the rollout server"):
        IpcWeightSender(client, "cpu")


def test_config_accepts_ipc_and_the_wire_model_round_trips() -> None:
    assert RolloutConfig(sync="ipc").sync.type == "ipc"
    with pytest.raises(ValueError, match="'http', 'file', 'nccl', 'ipc' or 'vllm'"):
        RolloutConfig(sync="shm")
    req = IpcUpdateRequest(
        tensors=[{"name": "w", "dtype": "bfloat16", "shape": [2, 4]}],
        buckets=[[0]],
        bucket_dtypes=["bfloat16"],
        handles=[_handle()],
        gpu_uuid="GPU-1",
    )
    assert IpcUpdateRequest.model_validate_json(req.model_dump_json()) == req
    with pytest.raises(ValueError):
        _handle(numel=0)
