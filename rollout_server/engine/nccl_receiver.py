"""The worker's side of the NCCL weight sync (``vllm_worker.WeightSyncWorkerExtension`` holds
one ``NcclReceiver``; the protocol is in ``vllm_worker``'s docstring).

``NcclReceiver`` owns the weight-sync communicator and everything kept between updates: the
staging buffers of the last layout (``_Staging``), the update queued by ``begin`` for
``finish`` (``_Pending``), the side stream, and the ``OverlapCopier`` that copies a prepared
update into the parameters as it lands (``overlap``). ``begin`` queues every segment's receive
and the commit word; ``finish`` waits for them and loads all or none through the worker's
``WorkerLoader``, acknowledges the load over the group when asked, and undoes a prepared
update's copies into the parameters if it does not commit. Import-safe without vLLM or a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rollout_server.engine.overlap import GPU_STAGING_MARGIN, Overlap, OverlapCopier
from rollout_server.engine.worker_loader import WorkerLoader, refuse_non_finite, tensor_key
from rollout_server.nccl_wire import (  # the wire format, shared with the learner
    Bucket,
    CancelFlag,
    NcclGroupError,
    bucket_layout,
    join_group,
    nccl_abort,
    unflatten,
    wait_event,
)
from rollout_server.weight_digest import flat_checksum

log = logging.getLogger(__name__)

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
    overlap: Overlap | None = None  # made by the first prepared update that can use it


@dataclass
class _Pending:
    """An update whose receives ``NcclReceiver.begin`` queued."""

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
    overlap: Overlap | None = None  # copied in as it lands (parameters saved): undo on failure
    copied: torch.cuda.Event | None = None  # with overlap: the last segment's copy
    ack: bool = False  # the learner waits for the load's acknowledgement after the word
    cancel: CancelFlag | None = None  # raised by the server: stop waiting for the bytes
    adapter_dir: str | None = None  # a LoRA adapter: written there, not loaded


def _stage_on_gpu(layout: list[Bucket], device: torch.device) -> bool:
    """Stage on the GPU when the whole update fits beside vLLM's pool, else in pinned CPU
    memory (slower: one extra copy each way, but it never OOMs a full server)."""
    free, _ = torch.cuda.mem_get_info(device)
    return sum(b.nbytes for b in layout) + GPU_STAGING_MARGIN < free


class NcclReceiver:
    def __init__(self, loader: WorkerLoader) -> None:
        self.loader = loader
        self._comm: Any = None
        self._timeout_s = 300.0
        self._staging: _Staging | None = None
        self._pending: _Pending | None = None  # queued by begin, for finish
        self._side_stream: torch.cuda.Stream | None = None  # prepared receives wait on it
        self._copier = OverlapCopier(loader)  # prepared copies into the parameters

    # -- the group and what is kept between updates ---------------------------------------

    def join(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float,
    ) -> None:
        """Join the weight-sync group as ``rank`` (``close_group`` first)."""
        if not 0 < rank < world_size:
            raise ValueError(
                f"worker rank {rank} does not fit world_size={world_size} (rank_offset="
                f"{rank_offset}); world_size must be 1 + every server worker"
            )
        self._comm = join_group(
            master_address, master_port, rank, world_size, self.loader.device(), timeout_s
        )
        self._timeout_s = float(timeout_s)
        log.info("joined the weight-sync group as rank %d of %d", rank, world_size)

    def close_group(self) -> None:
        """Drop the communicator, and any update queued on it. Abort, not destroy: destroy is
        collective and the learner may be gone; abort also ends receives still waiting."""
        pending, self._pending = self._pending, None
        if self._comm is not None:
            nccl_abort(self._comm)
            self._comm = None
        if pending is not None and pending.overlap is not None:
            self._copier.restore(pending.overlap)  # part of it may be in the parameters already
        if pending is not None and pending.kept is not None:
            self._staging = None  # an aborted receive may have written part of them

    def release_staging(self) -> None:
        """Free the kept GPU staging buffers (before sleeping: vLLM cannot offload them)."""
        if self._pending is not None and self._pending.prepared:
            raise RuntimeError("a prepared weight update is receiving into the staging buffers")
        if self._staging is not None:
            self._staging = None
            torch.cuda.empty_cache()

    # -- one update ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _group_dropped_on_failure(self) -> Iterator[None]:
        """A failure while receiving leaves the group unusable: forget it (``wait_event``
        already aborted it) or abort it; the next update needs a new init. The kept staging
        buffers go too: the aborted receives may have written part of them."""
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, NcclGroupError):
                self._comm = None  # aborted inside wait_event
            else:
                self.close_group()
            self._staging = None
            raise

    def begin(
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
        adapter_dir: str | None = None,
    ) -> float:
        """Queue the receive of every segment of every bucket and of the commit word, and
        return: staged on the GPU, the bytes arrive while the engine does other work (resets its
        prefix cache); staged on the CPU, they have all arrived when this returns.
        ``finish`` must follow. ``direct``: copy straight into the parameters once a
        copy plan is verified (else always ``load_weights``). ``prepared``: queued ahead of the
        broadcast (the service holds generation paused until the commit), on a side stream, off
        the forwards' stream; needs GPU staging (a CPU-staged receive cannot wait queued). A
        prepared update of a layout with a verified copy plan is also copied into the
        parameters segment by segment as it lands, the parameters saved first and restored if
        it does not commit (when the GPU has room for the saved copy). ``ack``: the finish
        acknowledges the load over the group (``_ack``). ``cancel_path``: a
        ``CancelFlag`` file the server creates to end the finish's wait for the bytes (a new
        init: they will not come). ``adapter_dir``: the update is a LoRA adapter, which the
        finish writes there (``WorkerLoader.save_adapter``) instead of loading. Returns the
        wall-clock time it started."""
        started = time.time()
        if self._pending is not None:  # a begin whose finish never came: state unknown
            self.close_group()
        comm = self._comm
        if comm is None:
            raise NcclGroupError(
                "no weight-sync group (never initialized, or aborted by a failed update); "
                "POST /weights/nccl/init first"
            )
        layout = bucket_layout(tensors, buckets, bucket_dtypes)
        device = self.loader.device()
        start = time.perf_counter()
        key = tuple((b.dtype, b.entries) for b in layout)
        kept, on_gpu = self._staging_for(layout, key, device, prepared)
        overlap = None
        if prepared and direct and kept is not None:
            overlap = self._copier.plan(
                kept.tensor_key, kept.weights, kept.overlap, layout, segment_bytes, device
            )
            if overlap is not None:
                kept.overlap = overlap  # kept with the buffers, for the next update
        staged, queued, word, copied = self._queue(
            comm, layout, device, on_gpu, kept, segment_bytes, prepared, overlap
        )
        self._pending = _Pending(
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
            adapter_dir,
        )
        return started

    def _staging_for(
        self, layout: list[Bucket], key: Any, device: torch.device, prepared: bool
    ) -> tuple[_Staging | None, bool]:
        """The kept staging buffers, if they are this layout's, and whether the update is
        staged on the GPU (a prepared one must be)."""
        kept = self._staging
        if kept is not None and kept.key != key:
            self.release_staging()  # another layout: its buffers are the wrong sizes
            kept = None
        on_gpu = kept is not None or _stage_on_gpu(layout, device)
        if prepared and not on_gpu:
            raise RuntimeError(
                f"preparing an update needs {sum(b.nbytes for b in layout) >> 20} MiB of free GPU "
                "memory to stage it; lower gpu_memory_utilization, or send it unprepared "
                "(staged in CPU memory)"
            )
        return kept, on_gpu

    def _queue(
        self,
        comm: Any,
        layout: list[Bucket],
        device: torch.device,
        on_gpu: bool,
        kept: _Staging | None,
        segment_bytes: int,
        prepared: bool,
        overlap: Overlap | None,
    ) -> tuple[list[torch.Tensor], list[torch.cuda.Event], torch.Tensor, torch.cuda.Event | None]:
        """Queue the receives of every segment and of the commit word (and, with ``overlap``,
        the copies into the parameters): on the side stream if ``prepared``, else on the
        forwards' stream. Returns the staged buffers, the receives' events, the commit word
        and the event the last copy records."""
        if prepared and self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
        forwards = torch.cuda.current_stream(device)
        stream = self._side_stream if prepared else forwards
        copied = None
        try:
            with self._group_dropped_on_failure(), torch.cuda.stream(stream):
                landed = None
                if overlap is not None:
                    landed, copied = self._copier.queue(overlap, forwards)
                staged, queued = self._receive_buckets(
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
                    self._copier.record_done(copied)
        except BaseException:
            if copied is not None:  # copies already queued behind receives that were aborted
                self._copier.restore(overlap)  # type: ignore[arg-type]
            raise
        return staged, queued, word, copied

    def drop_prepared(self) -> bool:
        """Give up a prepared update whose commit never came: the group is aborted (that ends
        the waiting receives); the learner must init again. Returns whether one was dropped."""
        if self._pending is None or not self._pending.prepared:
            return False
        self.close_group()
        return True

    def finish(self) -> dict[str, Any]:
        """Wait for the update ``begin`` queued, then load all of it or none."""
        p, self._pending = self._pending, None
        if p is None:
            raise RuntimeError("grpo_finish_update without a grpo_begin_update before it")
        finish_start = time.time()
        device = self.loader.device()
        total = None
        try:  # any failure: what the overlapped copies put in is undone, and the learner told
            received_s, received_at = self._wait_all(p, device)
            if p.checksum:
                total = float(
                    sum(
                        flat_checksum(f.to(device, non_blocking=True), b)
                        for b, f in enumerate(p.staged)
                    )
                )
            refuse_non_finite(p.staged, p.layout, device)
            if p.kept is not None:
                staging = p.kept  # the views into kept buffers are made once per layout
            else:
                weights = [
                    w for f, b in zip(p.staged, p.layout, strict=True) for w in unflatten(f, b)
                ]
                staging = _Staging(p.key, p.staged, weights, tensor_key(weights))
            if p.adapter_dir is not None:
                loader = self.loader.save_adapter(staging.weights, p.adapter_dir)
            elif p.overlap is not None:
                loader = "direct-overlapped"  # already in the parameters
            else:
                loader = self.loader.load_update(staging.weights, p.direct, staging.tensor_key)
        except BaseException:
            if p.overlap is not None:
                self._copier.restore(p.overlap)
            if p.ack and self._comm is not None:  # the word was read: the group is usable
                self._ack(False)
            raise
        loaded_at = time.time()
        if p.ack:
            self._ack(True)  # after the load's copies on this stream
        if p.on_gpu and loader != "load_weights":  # the parameters hold copies, not buffers
            self._staging = staging  # reused by the next update of this layout
        on_gpu = p.on_gpu
        del staging, p
        if self._staging is None:
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

    def _ack(self, loaded: bool) -> None:
        """Add 1 (``loaded``) or 0 to the learner's sum all-reduce that follows the commit word,
        on the forwards' stream (after the load's copies), and wait for it: it completes once
        the learner and every other worker are in it. A failure here drops the group (the
        learner times out or re-initializes) but not the load."""
        comm, device = self._comm, self.loader.device()
        stream = torch.cuda.current_stream(device)
        flag = torch.full((1,), int(loaded), dtype=torch.int32, device=device)
        comm.all_reduce(flag, flag, stream=stream)
        done = torch.cuda.Event()
        done.record(stream)
        try:
            wait_event(done, comm, self._timeout_s, "the load's acknowledgement")
        except NcclGroupError as exc:
            self._comm = None  # aborted inside wait_event
            log.warning("%s; the next update needs a new init", exc)

    def _wait_all(self, p: _Pending, device: torch.device) -> tuple[float, float]:
        """``_wait_received``, then the overlapped copies into the parameters, and have the
        forwards' stream wait for all of it."""
        received_s, received_at = self._wait_received(p)
        if p.overlap is not None:
            assert p.copied is not None
            self._copier.wait(p.copied, device)
        torch.cuda.current_stream(device).wait_event(p.queued[-1])  # prepared: side stream
        return received_s, received_at

    def _wait_received(self, p: _Pending) -> tuple[float, float]:
        """Wait for every segment and the commit word; raise unless the word says commit."""
        with self._group_dropped_on_failure():
            n = len(p.queued) - 1
            for k, done in enumerate(p.queued):  # the timeout counts from the previous one
                what = f"segment {k + 1}/{n}" if k < n else "commit word"
                wait_event(done, self._comm, self._timeout_s, what, p.cancel)
            committed = int(p.word.item()) == 1
        if not committed:
            raise RuntimeError(
                "the learner abandoned this update part way (commit word 0); nothing was loaded"
            )
        return time.perf_counter() - p.start, time.time()

    def _receive_buckets(
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
            wait_event(done, comm, self._timeout_s, f"bucket {len(staged) + 1}/{len(layout)}")
            host = torch.empty(bucket.numel, dtype=bucket.dtype, pin_memory=True)
            host.copy_(flat)
            staged.append(host)
        return staged, queued
