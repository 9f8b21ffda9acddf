"""CUDA IPC handles for the ``ipc`` weight transport (learner and server on one GPU).

The learner packs its weights into flat GPU buffers and shares each through CUDA IPC
(``cudaIpcGetMemHandle``, via torch's ``storage._share_cuda_``); the server's workers open the
handles (``cudaIpcOpenMemHandle``) and load straight from the learner's memory: no host copy, no
serialization, no NCCL (which cannot join two ranks on one GPU).

On the wire a handle is plain JSON (``IpcHandle``: byte strings in base64), never a pickle: the
server builds the tensor with torch's own ``rebuild_cuda_tensor`` from checked fields.

The producer must keep each buffer alive until every consumer answered; torch's IPC reference
counter then lets ``torch.cuda.ipc_collect()`` return the memory. Import-safe without a GPU.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

from rollout_server.protocol import IpcHandle

if TYPE_CHECKING:
    import torch


class IpcError(RuntimeError):
    """A handle that cannot be opened here (another GPU, a dead producer, bad bytes)."""


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text.encode("ascii"), validate=True)


def gpu_uuid(device: torch.device | int) -> str:
    """The GPU's UUID: the same physical GPU has the same one in every process, whatever each
    process's ``CUDA_VISIBLE_DEVICES`` numbering."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def local_device(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; IpcError if it cannot see that GPU."""
    import torch

    seen = []
    for i in range(torch.cuda.device_count()):
        seen.append(gpu_uuid(i))
        if seen[-1] == uuid:
            return i
    raise IpcError(
        f"the learner's GPU {uuid} is not visible to this server (it sees {seen or 'no GPU'}): "
        "the ipc transport needs the learner and the server on the same GPU; use sync = 'nccl' "
        "for a server on other GPUs"
    )


def share(flat: torch.Tensor) -> IpcHandle:
    """A handle to a contiguous 1-D CUDA tensor (keep ``flat`` alive until it was opened and
    used by every consumer)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not flat.is_cuda or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("share() needs a contiguous 1-D CUDA tensor")
    _, args = reduce_tensor(flat)
    (_cls, size, stride, offset, _storage_cls, dtype, _device, handle, storage_bytes,
     storage_offset, _grad, ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    return IpcHandle(
        dtype=str(dtype).removeprefix("torch."),
        numel=int(size[0]),
        stride=int(stride[0]),
        tensor_offset=int(offset),
        handle=_b64(handle) or "",
        storage_bytes=int(storage_bytes),
        storage_offset_bytes=int(storage_offset),
        ref_counter_handle=_b64(ref_handle) or "",
        ref_counter_offset=int(ref_offset),
        event_handle=_b64(event_handle),
        event_sync_required=bool(event_sync),
    )


def open_handle(h: IpcHandle, device: int) -> torch.Tensor:
    """The producer's flat tensor, mapped into this process on ``device`` (no copy)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = getattr(torch, h.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise IpcError(f"unknown dtype {h.dtype!r} in an IPC handle")
    try:
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([h.numel]),
            (h.stride,),
            h.tensor_offset,
            torch.storage.TypedStorage,
            dtype,
            device,
            _unb64(h.handle),
            h.storage_bytes,
            h.storage_offset_bytes,
            False,
            _unb64(h.ref_counter_handle),
            h.ref_counter_offset,
            _unb64(h.event_handle),
            h.event_sync_required,
        )
    except (RuntimeError, ValueError, OSError, AssertionError) as exc:  # binascii: ValueError;
        # a CPU-only torch asserts
        raise IpcError(
            f"could not open a CUDA IPC handle ({exc}); the learner process must be alive, on "
            "the same GPU, and keep its buffers until the server answers"
        ) from exc
