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

The extension is a thin class of the methods vLLM calls by name: the NCCL group, its staging
state and steps 2 and 3 are an ``NcclReceiver`` (``nccl_receiver``); loading (copy plans, CUDA
IPC buckets, a file) is a ``WorkerLoader`` (``worker_loader``), which the receiver loads through.
Both are built on the extension's first call (vLLM builds the worker, so it has no
``__init__`` of its own).

Import-safe without vLLM or a GPU: vLLM is imported only inside the methods.
"""

from __future__ import annotations

from typing import Any

from rollout_server.engine.nccl_receiver import NcclReceiver
from rollout_server.engine.worker_loader import WorkerLoader


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
    """Mixed into vLLM's GPU worker (``self`` is the worker): the ``grpo_*`` RPC methods."""

    _grpo_nccl: NcclReceiver | None = None  # built on first use, with its WorkerLoader

    def _grpo_receiver(self) -> NcclReceiver:
        if self._grpo_nccl is None:
            self._grpo_nccl = NcclReceiver(WorkerLoader(self))
        return self._grpo_nccl

    def _grpo_loader(self) -> WorkerLoader:
        return self._grpo_receiver().loader

    # -- loading ---------------------------------------------------------------------------

    def grpo_params_checksum(self) -> float:
        """``params_checksum`` of this worker's model (its shard under tensor parallelism)."""
        from rollout_server.weight_digest import params_checksum

        return params_checksum(self._grpo_loader().model())

    def grpo_receive_ipc(
        self,
        tensors: list[dict[str, Any]],
        buckets: list[list[int]],
        bucket_dtypes: list[str],
        checksum: bool,
        handles: list[dict[str, Any]],
        gpu_uuid: str,
        direct: bool = True,
        adapter_dir: str | None = None,
    ) -> dict[str, Any]:
        """Load an update from the colocated learner's CUDA IPC buckets (``load_ipc``); with
        ``adapter_dir``, a LoRA adapter written there."""
        return self._grpo_loader().load_ipc(
            tensors, buckets, bucket_dtypes, checksum, handles, gpu_uuid, direct, adapter_dir
        )

    def grpo_load_file(self, path: str) -> int:
        """Load every tensor of a safetensors file (read whole before loading: all or none)."""
        return self._grpo_loader().load_file(path)

    # -- NCCL ------------------------------------------------------------------------------

    def grpo_init_weight_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float,
    ) -> int:
        """Join (or re-join) the weight-sync group; returns this worker's rank in it."""
        receiver = self._grpo_receiver()
        receiver.close_group()
        rank = _pick_rank(self, rank_offset)
        receiver.join(master_address, master_port, rank, rank_offset, world_size, timeout_s)
        return rank

    def grpo_close_weight_group(self) -> None:
        """Drop the communicator, and any update queued on it (``close_group``)."""
        self._grpo_receiver().close_group()

    def grpo_release_staging(self) -> None:
        """Free the kept GPU staging buffers (before sleeping: vLLM cannot offload them)."""
        self._grpo_receiver().release_staging()

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
        adapter_dir: str | None = None,
    ) -> float:
        """Queue an update's receives (``NcclReceiver.begin``); ``grpo_finish_update`` must
        follow. Returns the wall-clock time it started."""
        return self._grpo_receiver().begin(
            tensors,
            buckets,
            bucket_dtypes,
            checksum,
            direct,
            segment_bytes,
            prepared,
            ack,
            cancel_path,
            adapter_dir,
        )

    def grpo_finish_update(self) -> dict[str, Any]:
        """Wait for the queued update, then load all of it or none (``NcclReceiver.finish``)."""
        return self._grpo_receiver().finish()

    def grpo_drop_prepared(self) -> bool:
        """Give up a prepared update whose commit never came: the group is aborted (that ends
        the waiting receives); the learner must init again. Returns whether one was dropped."""
        return self._grpo_receiver().drop_prepared()
