"""Buckets and tensor streams of a weight update, shared by the NCCL and CUDA IPC senders.

Which tensors share a flat bucket (``plan_buckets``: runs of one dtype, in stream order), how a
stream's tensors are checked against the announced specs and copied into a bucket
(``take_tensors``, ``segment_views``, ``fill_bucket``; ``drain`` keeps ZeRO-3 ranks' gathers in
step), and the parts of an update that do not depend on the transport: the announce to every
server, the checksum check and the ``last_stats``. Both senders (``learner.sync.nccl_sender``,
``learner.sync.ipc``) use them. Import-safe without a GPU.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_server.client import RolloutError, WeightSyncError
from rollout_server.nccl_wire import Bucket, BucketEntry, Segment, copy_all
from rollout_server.protocol import TensorSpec, WeightUpdateResponse

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class BucketPlan:
    buckets: list[list[int]]  # indices into the specs, in order
    dtypes: list[str]


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> BucketPlan:
    """Contiguous runs of ``specs`` of one dtype, each at most ``bucket_bytes`` (a larger tensor
    gets a bucket of its own). Runs stay in order because the tensors arrive as a stream."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[int]] = []
    dtypes: list[str] = []
    size = 0
    for i, spec in enumerate(specs):
        if spec.dtype not in _ITEMSIZE:
            raise ValueError(f"tensor {spec.name!r}: dtype {spec.dtype!r} cannot be broadcast")
        nbytes = _ITEMSIZE[spec.dtype] * _numel(spec.shape)
        if not buckets or dtypes[-1] != spec.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            dtypes.append(spec.dtype)
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return BucketPlan(buckets, dtypes)


def specs_bytes(specs: Sequence[TensorSpec]) -> int:
    """Bytes of one update (every transport sends exactly the announced tensors)."""
    return sum(_ITEMSIZE[s.dtype] * _numel(s.shape) for s in specs)


def update_stats(start: float, specs: Sequence[TensorSpec], **phases: float) -> dict[str, float]:
    """A sender's ``last_stats`` of one update: its own phases' seconds, the whole update's
    (since ``start``, a ``time.perf_counter()``) and the bytes it carried."""
    return {**phases, "total_s": time.perf_counter() - start, "bytes": float(specs_bytes(specs))}


def check_checksums(
    servers: Sequence[str], responses: Sequence[WeightUpdateResponse], sent: float
) -> None:
    """Each server's checksum of what it loaded must be the learner's of what it sent."""
    for server, r in zip(servers, responses, strict=True):
        if r.checksum is None or abs(r.checksum - sent) > 1e-9 * max(1.0, abs(sent)):
            raise WeightSyncError(server, f"checksum {r.checksum} differs from the sent {sent}")


async def announce_to_all(
    servers: Sequence[str],
    post: Callable[[str], Awaitable[WeightUpdateResponse]],
    transport: str,
    *,
    wait_for_all: bool = False,
) -> list[WeightUpdateResponse]:
    """``post`` the update to every server at once; a refusal becomes a ``WeightSyncError``
    naming the server. With ``wait_for_all`` every server answers before one failure is
    raised (they may still be reading the learner's buffers); without, the first one raises."""

    async def one(server: str) -> WeightUpdateResponse:
        try:
            return await post(server)
        except RolloutError as e:
            raise WeightSyncError(
                server, f"{transport} update failed, its previous weights still serve: {e}"
            ) from e

    if not wait_for_all:
        return list(await asyncio.gather(*(one(s) for s in servers)))
    results = await asyncio.gather(*(one(s) for s in servers), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)  # type: ignore[arg-type]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def take_tensors(entries: Sequence[BucketEntry], it: Iterator[tuple[str, Any]]) -> list[Any]:
    """The stream's next tensors, one per entry; raises if a name or shape differs from what
    the specs announced."""
    parts = []
    for e in entries:
        try:
            name, tensor = next(it)
        except StopIteration:
            raise ValueError(f"the tensor stream ended before {e.name!r}") from None
        if name != e.name or tuple(tensor.shape) != e.shape:
            raise ValueError(
                f"the tensor stream yielded {name!r} {list(tensor.shape)} where the specs "
                f"announced {e.name!r} {list(e.shape)}; build specs and stream from one model"
            )
        parts.append(tensor)
    return parts


def segment_views(flat: torch.Tensor, bucket: Bucket, g: Segment) -> list[torch.Tensor]:
    """Views of ``flat`` (segment ``g``'s buffer) shaped as its tensors, back to back."""
    out, offset = [], 0
    for e in bucket.entries[g.first : g.stop]:
        out.append(flat.narrow(0, offset, e.numel).view(e.shape))
        offset += e.numel
    return out


def fill_bucket(flat: torch.Tensor, bucket: Bucket, it: Iterator[tuple[str, Any]]) -> None:
    """Copy (and cast) the next tensors of the stream into their places in ``flat``."""
    whole = Segment(0, len(bucket.entries), 0, bucket.numel)
    copy_all(segment_views(flat, bucket, whole), take_tensors(bucket.entries, it))


def drain(it: Any, quiet: bool) -> None:
    """Consume what is left so every ZeRO-3 rank runs the same gathers."""
    try:
        for _ in it:
            pass
    except Exception:
        if not quiet:
            raise
        log.warning("the tensor stream failed again while being drained", exc_info=True)
