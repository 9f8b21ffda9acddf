"""A prepared NCCL update copied into the parameters segment by segment as each lands, on a
copy stream of its own, and undone if it does not commit (``nccl_receiver``).

The parameters are saved in GPU memory first (when there is room for the copy), so the load
stays all or none: a commit word 0 or an aborted group puts the saved parameters back. Only
layouts whose copy plan ``WorkerLoader`` verified are overlapped. Import-safe without a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rollout_server.nccl_wire import Bucket, copy_all, wait_event

if TYPE_CHECKING:
    from rollout_server.engine.worker_loader import WorkerLoader

log = logging.getLogger(__name__)

GPU_STAGING_MARGIN = 1 << 30  # leave this much free memory when staging buckets on the GPU
_RESTORE_TIMEOUT_S = 120.0


@dataclass
class Overlap:
    """How a prepared update of one layout is copied into the parameters segment by segment,
    as each lands, and undone if it does not commit: the parameters are saved first."""

    segment_bytes: int
    copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]]  # per segment: (dests, sources)
    dests: list[torch.Tensor]  # every destination
    saved: list[torch.Tensor]  # one view per destination, into the saved copy


class OverlapCopier:
    """Owns the copy stream; plans, queues, awaits and undoes the overlapped copies."""

    def __init__(self, loader: WorkerLoader) -> None:
        self.loader = loader
        self._stream: torch.cuda.Stream | None = None

    def plan(
        self,
        tensor_key: tuple,
        weights: list[tuple[str, torch.Tensor]],
        current: Overlap | None,
        layout: list[Bucket],
        segment_bytes: int,
        device: torch.device,
    ) -> Overlap | None:
        """The per-segment copies of the kept staging buffers' layout (``tensor_key``, their
        ``weights`` views; ``current``: the overlap made for them before, if any), or None: no
        verified copy plan, or no GPU room to save the parameters."""
        plan = self.loader.verified_plan(tensor_key)
        if plan is None:
            return None
        if current is not None and current.segment_bytes == segment_bytes:
            return current
        dest_of = dict(zip(plan.sources, plan.dests, strict=True))
        copies, base = [], 0
        for bucket in layout:
            for g in bucket.segments(segment_bytes):
                pairs = [
                    (dest_of[i], weights[i][1])
                    for i in range(base + g.first, base + g.stop)
                    if i in dest_of
                ]
                copies.append(([d for d, _ in pairs], [t for _, t in pairs]))
            base += len(bucket.entries)
        dests = list(plan.dests)
        if current is not None:  # another segment size: the saved copy is the same
            saved = current.saved
        else:
            nbytes = sum(d.numel() * d.element_size() for d in dests)
            free, _ = torch.cuda.mem_get_info(device)
            if nbytes + GPU_STAGING_MARGIN > free:
                log.info("no GPU room to save the parameters (%d MiB): prepared updates are "
                         "copied in after the commit", nbytes >> 20)  # fmt: skip
                return None
            saved = [torch.empty_like(d) for d in dests]
        return Overlap(segment_bytes, copies, dests, saved)

    def queue(self, overlap: Overlap, forwards: torch.cuda.Stream) -> tuple[Any, torch.cuda.Event]:
        """Save the parameters on the copy stream, then return ``landed(event)``, which makes
        the copy stream copy the next segment into the parameters once ``event`` (its receive)
        has completed; and the event the last copy will record (``record_done``)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(forwards.device)
        copy = self._stream
        copy.wait_stream(forwards)  # the last forwards are done (generation is held)
        with torch.cuda.stream(copy):
            copy_all(overlap.saved, overlap.dests)
        segments = iter(overlap.copies)

        def landed(event: torch.cuda.Event) -> None:
            dests, sources = next(segments)
            copy.wait_event(event)
            if dests:
                with torch.cuda.stream(copy):
                    copy_all(dests, sources)

        return landed, torch.cuda.Event()

    def record_done(self, copied: torch.cuda.Event) -> None:
        """Record ``copied`` on the copy stream, after every copy queued so far."""
        copied.record(self._stream)

    def wait(self, copied: torch.cuda.Event, device: torch.device) -> None:
        """Wait for the copies (``copied``), and have the forwards' stream wait for them."""
        assert self._stream is not None
        wait_event(copied, None, _RESTORE_TIMEOUT_S, "the copies into the parameters")
        torch.cuda.current_stream(device).wait_stream(self._stream)

    def restore(self, overlap: Overlap) -> None:
        """Put the saved parameters back (after the group was aborted, or a commit word 0):
        the update's copies that already ran are undone."""
        copy = self._stream
        assert copy is not None
        with torch.cuda.stream(copy):  # after the queued copies, which end once their
            copy_all(overlap.dests, overlap.saved)  # receives do
        done = torch.cuda.Event()
        done.record(copy)
        wait_event(done, None, _RESTORE_TIMEOUT_S, "restoring the saved parameters")
        torch.cuda.current_stream(self.loader.device()).wait_stream(copy)
        log.warning("a prepared update did not commit: the saved parameters are back")
