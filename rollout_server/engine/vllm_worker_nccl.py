"""The NCCL update half of the vLLM worker extension (``vllm_worker.WeightSyncWorkerExtension``).

``NcclUpdateMixin`` is the worker's side of one NCCL update (steps 2 and 3 of the protocol in
``vllm_worker``'s docstring): every segment's receive and the commit word queued
(``grpo_begin_update``), then awaited and loaded all or none (``grpo_finish_update``), the
acknowledgement over the group, and a prepared update's copies into the parameters as it lands,
undone if it does not commit. The staging state kept between updates (``_Staging``,
``_Overlap``, ``_Pending``) lives here too, as do the checks every received update passes before
it is loaded (``_refuse_non_finite``, ``tensor_key``; the CUDA IPC path imports them). The
extension inherits the mixin and owns what it reads (``_grpo_comm``, ``_grpo_staging``, the
loaders); apart so that each file reads in one sitting. Import-safe without vLLM or a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rollout_server.nccl_wire import (  # the wire format, shared with the learner
    Bucket,
    CancelFlag,
    NcclGroupError,
    bucket_layout,
    copy_all,
    flat_checksum,
    unflatten,
    wait_event,
)

log = logging.getLogger(__name__)

_GPU_STAGING_MARGIN = 1 << 30  # leave this much free memory when staging buckets on the GPU
_RESTORE_TIMEOUT_S = 120.0
_CANCELLED = (
    "cancelled by the server: the weight-sync group is being formed again "
    "(POST /weights/nccl/init), so this broadcast will not come"
)


@dataclass
class _Staging:
    """GPU staging buffers kept for the next update of one layout, with the views the loader
    reads (made once per layout, not per update)."""

    key: Any  # the bucket layout
    buffers: list[torch.Tensor]
    weights: list[tuple[str, torch.Tensor]]  # (name, view into a buffer), in announce order
    tensor_key: tuple  # ((name, shape, dtype), ...): the copy plans' key
    overlap: _Overlap | None = None  # made by the first prepared update that can use it


@dataclass
class _Overlap:
    """How a prepared update of one layout is copied into the parameters segment by segment,
    as each lands, and undone if it does not commit: the parameters are saved first."""

    segment_bytes: int
    copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]]  # per segment: (dests, sources)
    dests: list[torch.Tensor]  # every destination
    saved: list[torch.Tensor]  # one view per destination, into the saved copy


@dataclass
class _Pending:
    """An update whose receives ``grpo_begin_update`` queued."""

    layout: list[Bucket]
    key: Any
    staged: list[torch.Tensor]
    queued: list[torch.cuda.Event]  # one per bucket received on the GPU, then the commit word's
    word: torch.Tensor
    on_gpu: bool
    checksum: bool
    direct: bool
    start: float  # perf_counter
    started: float  # wall clock
    kept: _Staging | None  # the kept buffers the bytes land in, if any
    prepared: bool  # queued ahead of the broadcast, on the side stream
    overlap: _Overlap | None = None  # copied in as it lands (parameters saved): undo on failure
    copied: torch.cuda.Event | None = None  # with overlap: the last segment's copy
    ack: bool = False  # the learner waits for the load's acknowledgement after the word
    cancel: CancelFlag | None = None  # raised by the server: stop waiting for the bytes


def _refuse_non_finite(
    flats: list[torch.Tensor], layout: list[Bucket], device: torch.device
) -> None:
    """Before anything is loaded (or, for copies overlapped with the wire, before they commit):
    NaN/inf would load fine and then make every log-prob NaN."""
    from rollout_server.engine.base import WeightsError
    from rollout_server.finite import NON_FINITE_REFUSED, non_finite_buckets

    problem = non_finite_buckets(flats, layout, device)
    if problem:
        raise WeightsError(f"{NON_FINITE_REFUSED}: {problem}")


def tensor_key(weights: list[tuple[str, torch.Tensor]]) -> tuple:
    """What a copy plan depends on: every tensor's name, shape and dtype, in order."""
    return tuple((n, tuple(t.shape), t.dtype) for n, t in weights)


def _stage_on_gpu(layout: list[Bucket], device: torch.device) -> bool:
    """Stage on the GPU when the whole update fits beside vLLM's pool, else in pinned CPU
    memory (slower: one extra copy each way, but it never OOMs a full server)."""
    free, _ = torch.cuda.mem_get_info(device)
    return sum(b.nbytes for b in layout) + _GPU_STAGING_MARGIN < free


class NcclUpdateMixin:
    """``WeightSyncWorkerExtension``'s NCCL update methods (see the module docstring)."""

    # -- NCCL update -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _grpo_group_dropped_on_failure(self) -> Iterator[None]:
        """A failure while receiving leaves the group unusable: forget it (``wait_event``
        already aborted it) or abort it; the next update needs a new init. The kept staging
        buffers go too: the aborted receives may have written part of them."""
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, NcclGroupError):
                self._grpo_comm = None  # aborted inside wait_event
            else:
                self.grpo_close_weight_group()
            self._grpo_staging = None
            raise

    def grpo_begin_update(
        self,
        tensors: list[dict[str, Any]],
        buckets: list[list[int]],
        bucket_dtypes: list[str],
        checksum: bool,
        direct: bool = True,
        segment_bytes: int = 64 << 20,
        prepared: bool = False,
        ack: bool = False,
        cancel_path: str | None = None,
    ) -> float:
        """Queue the receive of every segment of every bucket and of the commit word, and
        return: staged on the GPU, the bytes arrive while the engine does other work (resets its
        prefix cache); staged on the CPU, they have all arrived when this returns.
        ``grpo_finish_update`` must follow. ``direct``: copy straight into the parameters once a
        copy plan is verified (else always ``load_weights``). ``prepared``: queued ahead of the
        broadcast (the service holds generation paused until the commit), on a side stream, off
        the forwards' stream; needs GPU staging (a CPU-staged receive cannot wait queued). A
        prepared update of a layout with a verified copy plan is also copied into the
        parameters segment by segment as it lands, the parameters saved first and restored if
        it does not commit (when the GPU has room for the saved copy). ``ack``: the finish
        acknowledges the load over the group (``_grpo_ack``). ``cancel_path``: a
        ``CancelFlag`` file the server creates to end the finish's wait for the bytes (a new
        init: they will not come). Returns the wall-clock time it started."""
        started = time.time()
        if self._grpo_pending is not None:  # a begin whose finish never came: state unknown
            self.grpo_close_weight_group()
        comm = self._grpo_comm
        if comm is None:
            raise NcclGroupError(
                "no weight-sync group (never initialized, or aborted by a failed update); "
                "POST /weights/nccl/init first"
            )
        layout = bucket_layout(tensors, buckets, bucket_dtypes)
        device = self._grpo_device()
        start = time.perf_counter()
        key = tuple((b.dtype, b.entries) for b in layout)
        kept = self._grpo_staging
        if kept is not None and kept.key != key:
            self.grpo_release_staging()  # another layout: its buffers are the wrong sizes
            kept = None
        on_gpu = kept is not None or _stage_on_gpu(layout, device)
        if prepared and not on_gpu:
            raise RuntimeError(
                f"preparing an update needs {sum(b.nbytes for b in layout) >> 20} MiB of free GPU "
                "memory to stage it; lower gpu_memory_utilization, or send it unprepared "
                "(staged in CPU memory)"
            )
        overlap = None
        if prepared and direct and kept is not None:
            overlap = self._grpo_overlap(kept, layout, segment_bytes, device)
        if prepared and self._grpo_side_stream is None:
            self._grpo_side_stream = torch.cuda.Stream(device)
        forwards = torch.cuda.current_stream(device)
        stream = self._grpo_side_stream if prepared else forwards
        copied = None
        try:
            with self._grpo_group_dropped_on_failure(), torch.cuda.stream(stream):
                landed = None
                if overlap is not None:
                    landed, copied = self._grpo_queue_copies(overlap, forwards)
                staged, queued = self._grpo_receive_buckets(
                    comm,
                    layout,
                    device,
                    on_gpu,
                    kept.buffers if kept is not None else None,
                    segment_bytes,
                    landed,
                )
                word = torch.zeros(1, dtype=torch.int32, device=device)
                comm.broadcast(word, src=0, stream=stream)
                queued.append(torch.cuda.Event())
                queued[-1].record(stream)
                if copied is not None:
                    copied.record(self._grpo_copy_stream)
        except BaseException:
            if copied is not None:  # copies already queued behind receives that were aborted
                self._grpo_restore(overlap)  # type: ignore[arg-type]
            raise
        self._grpo_pending = _Pending(
            layout,
            key,
            staged,
            queued,
            word,
            on_gpu,
            checksum,
            direct,
            start,
            started,
            kept,
            prepared,
            overlap,
            copied,
            ack,
            None if cancel_path is None else CancelFlag(cancel_path, _CANCELLED),
        )
        return started

    def _grpo_overlap(
        self, kept: _Staging, layout: list[Bucket], segment_bytes: int, device: torch.device
    ) -> _Overlap | None:
        """The per-segment copies of this layout (made once), or None: no verified copy plan,
        or no GPU room to save the parameters."""
        plan = (self._grpo_plans or {}).get(kept.tensor_key)
        if plan is None:
            return None
        if kept.overlap is not None and kept.overlap.segment_bytes == segment_bytes:
            return kept.overlap
        dest_of = dict(zip(plan.sources, plan.dests, strict=True))
        copies, base = [], 0
        for bucket in layout:
            for g in bucket.segments(segment_bytes):
                pairs = [
                    (dest_of[i], kept.weights[i][1])
                    for i in range(base + g.first, base + g.stop)
                    if i in dest_of
                ]
                copies.append(([d for d, _ in pairs], [t for _, t in pairs]))
            base += len(bucket.entries)
        dests = list(plan.dests)
        if kept.overlap is not None:  # another segment size: the saved copy is the same
            saved = kept.overlap.saved
        else:
            nbytes = sum(d.numel() * d.element_size() for d in dests)
            free, _ = torch.cuda.mem_get_info(device)
            if nbytes + _GPU_STAGING_MARGIN > free:
                log.info("no GPU room to save the parameters (%d MiB): prepared updates are "
                         "copied in after the commit", nbytes >> 20)  # fmt: skip
                return None
            saved = [torch.empty_like(d) for d in dests]
        kept.overlap = _Overlap(segment_bytes, copies, dests, saved)
        return kept.overlap

    def _grpo_queue_copies(
        self, overlap: _Overlap, forwards: torch.cuda.Stream
    ) -> tuple[Any, torch.cuda.Event]:
        """Save the parameters on the copy stream, then return ``landed(event)``, which makes
        the copy stream copy the next segment into the parameters once ``event`` (its receive)
        has completed; and the event the last copy will record."""
        if self._grpo_copy_stream is None:
            self._grpo_copy_stream = torch.cuda.Stream(forwards.device)
        copy = self._grpo_copy_stream
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

    def _grpo_restore(self, overlap: _Overlap) -> None:
        """Put the saved parameters back (after the group was aborted, or a commit word 0):
        the update's copies that already ran are undone."""
        copy = self._grpo_copy_stream
        assert copy is not None
        with torch.cuda.stream(copy):  # after the queued copies, which end once their
            copy_all(overlap.dests, overlap.saved)  # receives do
        done = torch.cuda.Event()
        done.record(copy)
        wait_event(done, None, _RESTORE_TIMEOUT_S, "restoring the saved parameters")
        torch.cuda.current_stream(self._grpo_device()).wait_stream(copy)
        log.warning("a prepared update did not commit: the saved parameters are back")

    def grpo_drop_prepared(self) -> bool:
        """Give up a prepared update whose commit never came: the group is aborted (that ends
        the waiting receives); the learner must init again. Returns whether one was dropped."""
        if self._grpo_pending is None or not self._grpo_pending.prepared:
            return False
        self.grpo_close_weight_group()
        return True

    def grpo_finish_update(self) -> dict[str, Any]:
        """Wait for the update ``grpo_begin_update`` queued, then load all of it or none."""
        p, self._grpo_pending = self._grpo_pending, None
        if p is None:
            raise RuntimeError("grpo_finish_update without a grpo_begin_update before it")
        finish_start = time.time()
        device = self._grpo_device()
        total = None
        try:  # any failure: what the overlapped copies put in is undone, and the learner told
            received_s, received_at = self._grpo_wait_received(p)
            if p.overlap is not None:
                assert p.copied is not None and self._grpo_copy_stream is not None
                wait_event(p.copied, None, _RESTORE_TIMEOUT_S, "the copies into the parameters")
                torch.cuda.current_stream(device).wait_stream(self._grpo_copy_stream)
            torch.cuda.current_stream(device).wait_event(p.queued[-1])  # prepared: side stream
            if p.checksum:
                total = float(sum(flat_checksum(f.to(device, non_blocking=True)) for f in p.staged))
            _refuse_non_finite(p.staged, p.layout, device)
            if p.kept is not None:
                staging = p.kept  # the views into kept buffers are made once per layout
            else:
                weights = [
                    w for f, b in zip(p.staged, p.layout, strict=True) for w in unflatten(f, b)
                ]
                staging = _Staging(p.key, p.staged, weights, tensor_key(weights))
            if p.overlap is not None:
                loader = "direct-overlapped"  # already in the parameters
            else:
                loader = self._grpo_load_update(staging.weights, p.direct, staging.tensor_key)
        except BaseException:
            if p.overlap is not None:
                self._grpo_restore(p.overlap)
            if p.ack and self._grpo_comm is not None:  # the word was read: the group is usable
                self._grpo_ack(False)
            raise
        loaded_at = time.time()
        if p.ack:
            self._grpo_ack(True)  # after the load's copies on this stream
        if p.on_gpu and loader != "load_weights":  # the parameters hold copies, not buffers
            self._grpo_staging = staging  # reused by the next update of this layout
        on_gpu = p.on_gpu
        del staging, p
        if self._grpo_staging is None:
            torch.cuda.empty_cache()  # staging memory back to the KV cache / sleep accounting
        return {
            "checksum": total,
            "received_s": received_s,
            "loaded_s": loaded_at - received_at,
            "staged_on": "gpu" if on_gpu else "cpu",
            "loader": loader,
            "timeline": {
                "worker_finish": finish_start,
                "received": received_at,
                "loaded": loaded_at,
                "acked": time.time(),
            },
        }

    def _grpo_ack(self, loaded: bool) -> None:
        """Add 1 (``loaded``) or 0 to the learner's sum all-reduce that follows the commit word,
        on the forwards' stream (after the load's copies), and wait for it: it completes once
        the learner and every other worker are in it. A failure here drops the group (the
        learner times out or re-initializes) but not the load."""
        comm, device = self._grpo_comm, self._grpo_device()
        stream = torch.cuda.current_stream(device)
        flag = torch.full((1,), int(loaded), dtype=torch.int32, device=device)
        comm.all_reduce(flag, flag, stream=stream)
        done = torch.cuda.Event()
        done.record(stream)
        try:
            wait_event(done, comm, self._grpo_timeout_s, "the load's acknowledgement")
        except NcclGroupError as exc:
            self._grpo_comm = None  # aborted inside wait_event
            log.warning("%s; the next update needs a new init", exc)

    def _grpo_wait_received(self, p: _Pending) -> tuple[float, float]:
        """Wait for every segment and the commit word; raise unless the word says commit."""
        with self._grpo_group_dropped_on_failure():
            n = len(p.queued) - 1
            for k, done in enumerate(p.queued):  # the timeout counts from the previous one
                what = f"segment {k + 1}/{n}" if k < n else "commit word"
                wait_event(done, self._grpo_comm, self._grpo_timeout_s, what, p.cancel)
            committed = int(p.word.item()) == 1
        if not committed:
            raise RuntimeError(
                "the learner abandoned this update part way (commit word 0); nothing was loaded"
            )
        return time.perf_counter() - p.start, time.time()

    def _grpo_receive_buckets(
        self,
        comm: Any,
        layout: list[Bucket],
        device: torch.device,
        on_gpu: bool,
        kept: list[torch.Tensor] | None,
        segment_bytes: int,
        landed: Any = None,
    ) -> tuple[list[torch.Tensor], list[torch.cuda.Event]]:
        """Staged on the GPU (in ``kept`` buffers when given), every segment's receive is
        queued at once (no gap between them) and their events returned, to be awaited in order
        (``landed(event)`` is called with each as it is queued); staged on the CPU, one reused
        GPU buffer per dtype is received into and copied out bucket by bucket, all before this
        returns (no events)."""
        stream = torch.cuda.current_stream(device)
        staged: list[torch.Tensor] = []
        recv: dict[torch.dtype, torch.Tensor] = {}
        queued: list[torch.cuda.Event] = []
        for b, bucket in enumerate(layout):
            if on_gpu:
                flat = (
                    kept[b]
                    if kept is not None
                    else torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
                )
            else:
                if bucket.dtype not in recv:
                    size = max(x.numel for x in layout if x.dtype == bucket.dtype)
                    recv[bucket.dtype] = torch.empty(size, dtype=bucket.dtype, device=device)
                flat = recv[bucket.dtype][: bucket.numel]
            for g in bucket.segments(segment_bytes):
                comm.broadcast(flat.narrow(0, g.offset, g.numel), src=0, stream=stream)
                if on_gpu:
                    queued.append(torch.cuda.Event())
                    queued[-1].record(stream)
                    if landed is not None:
                        landed(queued[-1])
            if on_gpu:
                staged.append(flat)
                continue
            done = torch.cuda.Event()
            done.record(stream)
            wait_event(done, comm, self._grpo_timeout_s, f"bucket {len(staged) + 1}/{len(layout)}")
            host = torch.empty(bucket.numel, dtype=bucket.dtype, pin_memory=True)
            host.copy_(flat)
            staged.append(host)
        return staged, queued
