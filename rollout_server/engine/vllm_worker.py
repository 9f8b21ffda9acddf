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

The NCCL update's methods (steps 2 and 3), with the staging state they keep, are in
``vllm_worker_nccl`` (``NcclUpdateMixin``, which this extension inherits).

Import-safe without vLLM or a GPU: vLLM is imported only inside the methods.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rollout_server.engine.vllm_worker_nccl import (
    NcclUpdateMixin,
    _Pending,
    _refuse_non_finite,
    _Staging,
    tensor_key,
)
from rollout_server.nccl_wire import (  # the wire format, shared with the learner
    bucket_layout,
    flat_checksum,
    join_group,
    nccl_abort,
    unflatten,
)

log = logging.getLogger(__name__)


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


class WeightSyncWorkerExtension(NcclUpdateMixin):
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
