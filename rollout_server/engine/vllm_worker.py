"""The vLLM worker extension that receives weight updates (NCCL buckets, CUDA IPC buckets from a
colocated learner, or a safetensors file).

vLLM mixes this class into each of its GPU workers (``worker_extension_cls``); ``VLLMEngine``
calls its methods through ``collective_rpc``, so every tensor-parallel/data-parallel worker runs
them. Method names carry a ``grpo_`` prefix so they never shadow vLLM's own worker methods.

The NCCL protocol, shared with ``learner.sync.nccl.NcclWeightSender`` (rank 0):

1. ``grpo_init_weight_group``: the learner and every worker join a ``StatelessProcessGroup``
   (TCP rendezvous on the learner) and build a ``PyNcclCommunicator`` over it.
2. One HTTP announce lists every tensor and the bucket layout; the server pauses generation and
   calls ``grpo_begin_update`` then ``grpo_finish_update``. Bucket ``b`` is one flat buffer of
   ``bucket_dtypes[b]`` holding its tensors back to back; rank 0 broadcasts the buckets in
   order, each in *segments* (runs of whole tensors of at most the announce's
   ``segment_bytes``, ``Bucket.segments``: both ends cut the same), then one int32 *commit
   word* (1 = every bucket is genuine, 0 = the sender failed part way and filled the rest with
   zeros).
   A *prepared* update splits this in two: ``grpo_begin_update(prepared=True)``
   (``POST /weights/nccl/prepare``, while the learner is still training; generation stays
   paused from then) queues the receives on a side stream and returns; ``POST
   /weights/nccl/commit`` calls ``grpo_finish_update``, which waits for the bytes. The learner
   posts that commit right after preparing, before it broadcasts, so neither the announce nor
   the commit is on the wire's path.
   With the announce's ``ack``, the commit word is followed by one int32 sum all-reduce over
   the group: each worker adds 1 once the update is in its parameters (after the load's copies
   on its stream), 0 if it read commit word 0 or failed to load, and the learner 0; the learner
   then knows every server loaded it without waiting for the HTTP answer.
   A prepared update of a layout whose copy plan is verified is copied into the parameters
   segment by segment as it lands (a copy stream waits on each receive), the parameters first
   saved in GPU memory; if it does not commit they are restored, so the load is still all or
   none, and the commit only waits for the last segment's copy.
3. The worker stages every bucket and loads nothing until the commit word says 1. A broadcast
   that fails or makes no progress for ``timeout_s`` (the sender died) aborts the communicator
   (``ncclCommAbort`` unblocks the stuck kernel); either way the staged buckets are dropped and
   the previous weights keep serving. After an abort the group must be initialized again.

Loading: the first update of a layout goes through vLLM's ``load_weights`` and verifies a copy
plan against it (``rollout_server.engine.direct_load``); later updates of that layout are copied
straight into the parameters. GPU staging buffers are kept between updates of one layout (no
allocation per sync) and released before the engine sleeps (``grpo_release_staging``).

Import-safe without vLLM or a GPU: vLLM is imported only inside the methods.
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
    join_group,
    nccl_abort,
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


def _pick_rank(worker: Any, rank_offset: int) -> int:
    """This worker's rank in the weight-sync group: learner = 0, then dp-major, tp/pp-minor."""
    pc = worker.vllm_config.parallel_config
    dp_index = getattr(pc, "data_parallel_index", None)
    if dp_index is None:
        dp_index = getattr(pc, "data_parallel_rank", 0) or 0
    local = getattr(worker, "rank", None)
    if local is None:
        from vllm.distributed.parallel_state import get_world_group

        local = get_world_group().rank_in_group
    return rank_offset + int(dp_index) * int(pc.world_size) + int(local)


class WeightSyncWorkerExtension:
    """Mixed into vLLM's GPU worker: ``self.model_runner`` and ``self.device`` come from it."""

    _grpo_comm: Any = None
    _grpo_timeout_s: float = 300.0
    # set per instance on first use (vLLM builds the worker; the extension has no __init__)
    _grpo_plans: dict[Any, Any] | None = None  # layout key -> verified CopyPlan, or None
    _grpo_staging: _Staging | None = None
    _grpo_pending: _Pending | None = None  # queued by begin/prepare, for grpo_finish_update
    _grpo_side_stream: torch.cuda.Stream | None = None  # prepared receives wait on it
    _grpo_copy_stream: torch.cuda.Stream | None = None  # prepared copies into the parameters

    # -- helpers ---------------------------------------------------------------------------

    def _grpo_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _grpo_device(self) -> torch.device:
        device = getattr(self, "device", None)
        return device if device is not None else torch.device("cuda", torch.cuda.current_device())

    def _grpo_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self._grpo_model().load_weights(weights=weights)
        torch.cuda.synchronize()

    def _grpo_load_update(
        self, weights: list[tuple[str, torch.Tensor]], direct: bool, key: tuple | None = None
    ) -> str:
        """Load one received update; returns how ("direct", "load_weights", or
        "load_weights+verify" for the first update of a layout). ``key``: ``tensor_key`` of
        ``weights``, when the caller has it."""
        from rollout_server.engine import direct_load

        if not direct:
            self._grpo_load(weights)
            return "load_weights"
        if self._grpo_plans is None or len(self._grpo_plans) > 64:  # many partial layouts
            self._grpo_plans = {}
        if key is None:
            key = tensor_key(weights)
        tensors = [t for _, t in weights]
        if key in self._grpo_plans:
            plan = self._grpo_plans[key]
            if plan is None:
                self._grpo_load(weights)
                return "load_weights"
            direct_load.copy_in(plan, tensors)
            torch.cuda.current_stream().synchronize()  # the forwards' stream, not the device
            return "direct"
        plan = self._grpo_copy_plan(key)
        if isinstance(plan, str):
            log.info("weight updates go through load_weights: %s", plan)
            self._grpo_plans[key] = None
            self._grpo_load(weights)
            return "load_weights"
        self._grpo_load(weights)
        problem = direct_load.verify(plan, tensors)
        if problem:
            log.warning("direct weight copies disagree with load_weights (%s); kept off", problem)
        else:
            log.info("direct weight copies verified for this layout (%d tensors)", len(key))
        self._grpo_plans[key] = None if problem else plan
        return "load_weights" if problem else "load_weights+verify"

    def _grpo_copy_plan(self, key: tuple) -> Any:
        """A copy plan for this layout, or why there is none (quantized or sharded models,
        updates of part of the model)."""
        from rollout_server.engine import direct_load

        config = self.vllm_config  # type: ignore[attr-defined]
        if getattr(config.model_config, "quantization", None):
            return "the model is quantized"
        if int(config.parallel_config.tensor_parallel_size) > 1:
            return "tensor parallelism shards the parameters"
        model = self._grpo_model()
        hf = getattr(config.model_config, "hf_config", None)
        tied = bool(getattr(hf, "tie_word_embeddings", False))
        return direct_load.plan_copies(
            dict(model.named_parameters()),
            [(n, s, d) for n, s, d in key],
            getattr(model, "packed_modules_mapping", None) or direct_load.COMMON_PACKED,
            skip=frozenset({"lm_head.weight"}) if tied else frozenset(),
        )

    def grpo_params_checksum(self) -> float:
        """``params_checksum`` of this worker's model (its shard under tensor parallelism)."""
        from rollout_server.nccl_wire import params_checksum

        return params_checksum(self._grpo_model())

    def grpo_release_staging(self) -> None:
        """Free the kept GPU staging buffers (before sleeping: vLLM cannot offload them)."""
        if self._grpo_pending is not None and self._grpo_pending.prepared:
            raise RuntimeError("a prepared weight update is receiving into the staging buffers")
        if self._grpo_staging is not None:
            self._grpo_staging = None
            torch.cuda.empty_cache()

    # -- NCCL group ------------------------------------------------------------------------

    def grpo_init_weight_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float,
    ) -> int:
        """Join (or re-join) the weight-sync group; returns this worker's rank in it."""
        self.grpo_close_weight_group()
        rank = _pick_rank(self, rank_offset)
        if not 0 < rank < world_size:
            raise ValueError(
                f"worker rank {rank} does not fit world_size={world_size} (rank_offset="
                f"{rank_offset}); world_size must be 1 + every server worker"
            )
        self._grpo_comm = join_group(
            master_address, master_port, rank, world_size, self._grpo_device(), timeout_s
        )
        self._grpo_timeout_s = float(timeout_s)
        log.info("joined the weight-sync group as rank %d of %d", rank, world_size)
        return rank

    def grpo_close_weight_group(self) -> None:
        """Drop the communicator, and any update queued on it. Abort, not destroy: destroy is
        collective and the learner may be gone; abort also ends receives still waiting."""
        pending, self._grpo_pending = self._grpo_pending, None
        if self._grpo_comm is not None:
            nccl_abort(self._grpo_comm)
            self._grpo_comm = None
        if pending is not None and pending.overlap is not None:
            self._grpo_restore(pending.overlap)  # part of it may be in the parameters already
        if pending is not None and pending.kept is not None:
            self._grpo_staging = None  # an aborted receive may have written part of them

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

    # -- CUDA IPC update (learner on this GPU) ---------------------------------------------

    def grpo_receive_ipc(
        self,
        tensors: list[dict[str, Any]],
        buckets: list[list[int]],
        bucket_dtypes: list[str],
        checksum: bool,
        handles: list[dict[str, Any]],
        gpu_uuid: str,
        direct: bool = True,
    ) -> dict[str, Any]:
        """Open every bucket's IPC handle (all of them before loading anything), then load
        straight from the learner's memory. The learner keeps the buffers until we answer."""
        from rollout_server.cuda_ipc import local_device, open_handle
        from rollout_server.protocol import IpcHandle

        layout = bucket_layout(tensors, buckets, bucket_dtypes)
        index = local_device(gpu_uuid)
        device = self._grpo_device()
        if device.index is not None and device.index != index:
            log.warning("IPC buckets live on GPU %d, this worker runs on %s", index, device)
        start = time.perf_counter()
        flats = [open_handle(IpcHandle(**h), index) for h in handles]
        try:
            for flat, b in zip(flats, layout, strict=True):
                if flat.numel() != b.numel or flat.dtype != b.dtype:
                    raise ValueError(f"an IPC bucket is {flat.numel()} x {flat.dtype}, not {b}")
            total = float(sum(flat_checksum(f) for f in flats)) if checksum else None
            _refuse_non_finite(flats, layout, device)
            received_s = time.perf_counter() - start
            weights = [w for f, b in zip(flats, layout, strict=True) for w in unflatten(f, b)]
            # synchronizes: the learner may free its buffers after
            loader = self._grpo_load_update(weights, direct)
            del weights
        finally:
            del flats
        return {
            "checksum": total,
            "received_s": received_s,
            "loaded_s": time.perf_counter() - start - received_s,
            "staged_on": "learner's gpu (ipc)",
            "loader": loader,
        }

    # -- file / HTTP transports ------------------------------------------------------------

    def grpo_load_file(self, path: str) -> int:
        """Load every tensor of a safetensors file (read whole before loading: all or none)."""
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            weights = [(n, f.get_tensor(n)) for n in names]
        self._grpo_load(weights)
        return len(weights)


def _refuse_non_finite(
    flats: list[torch.Tensor], layout: list[Bucket], device: torch.device
) -> None:
    """Before anything is loaded (or, for copies overlapped with the wire, before they commit):
    NaN/inf would load fine and then make every log-prob NaN."""
    from rollout_server.engine.base import WeightsError
    from rollout_server.weights import NON_FINITE_REFUSED, non_finite_buckets

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
