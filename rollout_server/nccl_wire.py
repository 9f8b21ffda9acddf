"""The NCCL weight-sync wire format, shared by both ends: the learner's sender
(``learner.sync.nccl``) and the rollout server's vLLM worker (``rollout_server.engine.vllm_worker``).

Bucket layout and joining / aborting the communicator live here so that the two ends share one
definition and the learner imports no engine code (the digest of what was sent is
``rollout_server.weight_digest``'s). torch is imported;
vLLM only inside ``join_group``. See ``rollout_server.engine.vllm_worker`` for the protocol.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

_POLL_S = 0.0005  # the longest sleep between polls; the first ones are much shorter
_POLL_FIRST_S = 0.00002
_POLL_FAST_S = 0.00005  # the longest sleep while the wait is young: a sync ends within ~50 us
_FAST_FOR_S = 0.2


def copy_all(dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``dests[k].copy_(sources[k])`` for every k as one fused multi-tensor copy on the current
    stream (a launch or a few, not one per tensor: a few hundred tensors would otherwise cost
    milliseconds of launches). Tensors of another dtype or device take torch's per-tensor
    path."""
    with torch.no_grad():
        torch._foreach_copy_(list(dests), list(sources))


@dataclass(frozen=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    offset: int  # elements into the bucket's flat buffer
    numel: int


@dataclass(frozen=True)
class Segment:
    """A run of a bucket's tensors that goes over the wire as one broadcast."""

    first: int  # index of its first entry in ``Bucket.entries``
    stop: int  # one past its last
    offset: int  # elements into the bucket's flat buffer
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    entries: tuple[BucketEntry, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def segments(self, segment_bytes: int) -> list[Segment]:
        """The bucket's broadcasts, in order: runs of whole tensors of at most
        ``segment_bytes`` (a larger tensor is a segment of its own). Both ends cut the same
        segments from the announce's ``segment_bytes``, so the sender's first segment is on the
        wire while it packs the next, and the receiver can use a segment as soon as it lands."""
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        limit = max(1, segment_bytes // self.itemsize)
        out: list[Segment] = []
        first = 0
        for k, e in enumerate(self.entries):
            if k > first and e.offset + e.numel - self.entries[first].offset > limit:
                out.append(self._segment(first, k))
                first = k
        if self.entries:
            out.append(self._segment(first, len(self.entries)))
        return out

    def _segment(self, first: int, stop: int) -> Segment:
        start, last = self.entries[first], self.entries[stop - 1]
        return Segment(first, stop, start.offset, last.offset + last.numel - start.offset)


def bucket_layout(
    tensors: list[dict[str, Any]], buckets: list[list[int]], bucket_dtypes: list[str]
) -> list[Bucket]:
    """Offsets of every tensor inside its bucket, from an announce (already validated by the
    service: every index once, dtypes matching). Pure: the learner builds the same layout."""
    out = []
    for indices, dtype_name in zip(buckets, bucket_dtypes, strict=True):
        entries, offset = [], 0
        for i in indices:
            spec = tensors[i]
            shape = tuple(int(d) for d in spec["shape"])
            numel = math.prod(shape)
            entries.append(BucketEntry(spec["name"], shape, offset, numel))
            offset += numel
        out.append(Bucket(getattr(torch, dtype_name), tuple(entries), offset))
    return out


def unflatten(flat: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors into its flat buffer (no copies)."""
    return [(e.name, flat.narrow(0, e.offset, e.numel).view(e.shape)) for e in bucket.entries]


class NcclGroupError(RuntimeError):
    """The weight-sync communicator failed or timed out and was aborted; re-initialize it."""


def nccl_abort(comm: Any) -> None:
    """``ncclCommAbort`` through vLLM's loaded libnccl (vLLM's wrapper does not export it).

    Unlike ``ncclCommDestroy`` it is not collective: it returns even when the peer is gone and
    makes kernels stuck waiting on that peer exit. The communicator is unusable afterwards."""
    handle = getattr(comm, "comm", None)
    lib = getattr(getattr(comm, "nccl", None), "lib", None)
    if handle is None or lib is None:
        return
    fn = lib.ncclCommAbort
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
    result = fn(handle)
    if result != 0:
        log.warning("ncclCommAbort returned %d", result)
    comm.comm = None
    comm.available, comm.disabled = False, True


def nccl_async_error(comm: Any) -> int:
    """``ncclCommGetAsyncError``: 0 while the communicator is healthy (e.g. no remote error)."""
    lib = getattr(getattr(comm, "nccl", None), "lib", None)
    if lib is None or getattr(comm, "comm", None) is None:
        return 0
    fn = lib.ncclCommGetAsyncError
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    err = ctypes.c_int(0)
    fn(comm.comm, ctypes.byref(err))
    return err.value


class CancelFlag:
    """A flag one process raises for another that is busy: a file, there once raised.

    The rollout server's API process uses it to end a commit its vLLM workers wait in (their
    RPCs run one at a time, so a cancel cannot queue behind the wait). ``is_set`` looks at the
    file at most every ``check_every_s``, so polling it in a tight wait costs next to nothing.
    Local processes only: the workers must see the server's temp directory."""

    def __init__(self, path: str, reason: str = "", check_every_s: float = 0.01) -> None:
        self.path = path
        self.reason = reason
        self._every = check_every_s
        self._next = 0.0
        self._set = False

    @classmethod
    def new(cls, reason: str = "") -> CancelFlag:
        """A fresh flag (its file not created) in the temp directory."""
        name = f"grpo-cancel-{os.getpid()}-{uuid.uuid4().hex}"
        return cls(os.path.join(tempfile.gettempdir(), name), reason)

    def set(self) -> None:
        with open(self.path, "a"):
            pass

    def is_set(self) -> bool:
        now = time.monotonic()
        if not self._set and now >= self._next:
            self._set = os.path.exists(self.path)
            self._next = now + self._every
        return self._set

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def wait_event(
    event: torch.cuda.Event, comm: Any, timeout_s: float, what: str, stop: Any = None
) -> None:
    """Block until ``event`` completes, polling so that a dead peer cannot hang us forever.

    On timeout, a NCCL async error, or ``stop`` being set (a threading.Event or a
    ``CancelFlag``; its ``reason``, if it has one, is the error's), the communicator is aborted
    and ``NcclGroupError`` raised."""
    now = time.monotonic()
    deadline, fast_until = now + timeout_s, now + _FAST_FOR_S
    delay = _POLL_FIRST_S  # doubles up to _POLL_FAST_S, later _POLL_S
    while not event.query():
        reason = None
        if stop is not None and stop.is_set():
            reason = getattr(stop, "reason", None) or "the update was cancelled by the other side"
        elif (err := nccl_async_error(comm)) != 0:
            reason = f"NCCL reported error {err}"
        elif time.monotonic() > deadline:
            reason = f"no progress for {timeout_s:.0f} s (is the other side alive?)"
        if reason:
            nccl_abort(comm)
            raise NcclGroupError(f"{what}: {reason}; the weight-sync group was aborted")
        time.sleep(delay)
        delay = min(2 * delay, _POLL_FAST_S if time.monotonic() < fast_until else _POLL_S)


def join_group(
    master_address: str, master_port: int, rank: int, world_size: int, device: Any, timeout_s: float
) -> Any:
    """Join the weight-sync group (rank 0 hosts the TCP rendezvous) and return the enabled
    ``PyNcclCommunicator``. Used by the workers here and by the learner's sender."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(
        host=master_address,
        port=master_port,
        rank=rank,
        world_size=world_size,
        store_timeout=max(1, int(timeout_s)),
    )
    comm = PyNcclCommunicator(group, device=device)
    if not getattr(comm, "available", True):
        raise NcclGroupError("vLLM could not load libnccl; NCCL weight sync needs CUDA GPUs")
    # Some vLLM releases leave a fresh communicator disabled (for CUDA-graph capture only).
    comm.disabled = False
    return comm
