"""The vLLM worker extension that receives weight updates (NCCL buckets or a safetensors file).

vLLM mixes this class into each of its GPU workers (``worker_extension_cls``); ``VLLMEngine``
calls its methods through ``collective_rpc``, so every tensor-parallel/data-parallel worker runs
them. Method names carry a ``grpo_`` prefix so they never shadow vLLM's own worker methods.

The NCCL protocol, shared with ``learner.sync.nccl.NcclWeightSender`` (rank 0):

1. ``grpo_init_weight_group``: the learner and every worker join a ``StatelessProcessGroup``
   (TCP rendezvous on the learner) and build a ``PyNcclCommunicator`` over it.
2. One HTTP announce lists every tensor and the bucket layout; the server pauses generation and
   calls ``grpo_receive_update``. Bucket ``b`` is one flat buffer of ``bucket_dtypes[b]`` holding
   its tensors back to back; rank 0 broadcasts the buckets in order, then one int32 *commit word*
   (1 = every bucket is genuine, 0 = the sender failed part way and filled the rest with zeros).
3. The worker stages every bucket and loads nothing until the commit word says 1. A broadcast
   that fails or makes no progress for ``timeout_s`` (the sender died) aborts the communicator
   (``ncclCommAbort`` unblocks the stuck kernel); either way the staged buckets are dropped and
   the previous weights keep serving. After an abort the group must be initialized again.

Import-safe without vLLM or a GPU: vLLM is imported only inside the methods.
"""

from __future__ import annotations

import ctypes
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# One float64 checksum per update: sum(x) + sum(x*x) over every element of every bucket, summed
# bucket by bucket in chunks of CHECKSUM_CHUNK elements. The learner computes it the same way
# (learner.sync.nccl.flat_checksum) over the same flat buffers, so equal numbers mean equal bytes.
CHECKSUM_CHUNK = 1 << 26
_POLL_S = 0.0005
_GPU_STAGING_MARGIN = 1 << 30  # leave this much free memory when staging buckets on the GPU


def flat_checksum(flat: torch.Tensor, chunk: int = CHECKSUM_CHUNK) -> torch.Tensor:
    """Float64 ``sum(x) + sum(x*x)`` of a 1-D tensor, as a 0-d tensor (no host sync)."""
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk].double()  # [<=chunk]
        total += part.sum() + part.square().sum()
    return total


@dataclass(frozen=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    offset: int  # elements into the bucket's flat buffer
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    entries: tuple[BucketEntry, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


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


def wait_event(
    event: torch.cuda.Event, comm: Any, timeout_s: float, what: str, stop: Any = None
) -> None:
    """Block until ``event`` completes, polling so that a dead peer cannot hang us forever.

    On timeout, a NCCL async error, or ``stop`` being set (a threading.Event), the communicator
    is aborted and ``NcclGroupError`` raised."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        reason = None
        if stop is not None and stop.is_set():
            reason = "the update was cancelled by the other side"
        elif (err := nccl_async_error(comm)) != 0:
            reason = f"NCCL reported error {err}"
        elif time.monotonic() > deadline:
            reason = f"no progress for {timeout_s:.0f} s (is the other side alive?)"
        if reason:
            nccl_abort(comm)
            raise NcclGroupError(f"{what}: {reason}; the weight-sync group was aborted")
        time.sleep(_POLL_S)


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
        """Drop the communicator. Abort, not destroy: destroy is collective and the learner may
        be gone."""
        if self._grpo_comm is not None:
            nccl_abort(self._grpo_comm)
            self._grpo_comm = None

    # -- NCCL update -----------------------------------------------------------------------

    def grpo_receive_update(
        self,
        tensors: list[dict[str, Any]],
        buckets: list[list[int]],
        bucket_dtypes: list[str],
        checksum: bool,
    ) -> dict[str, Any]:
        """Receive every announced bucket, then load them all, or none."""
        comm = self._grpo_comm
        if comm is None:
            raise NcclGroupError(
                "no weight-sync group (never initialized, or aborted by a failed update); "
                "POST /weights/nccl/init first"
            )
        layout = bucket_layout(tensors, buckets, bucket_dtypes)
        device = self._grpo_device()
        on_gpu = _stage_on_gpu(layout, device)
        start = time.perf_counter()
        staged: list[torch.Tensor] = []
        try:
            staged = self._grpo_receive_buckets(comm, layout, device, on_gpu)
            committed = self._grpo_receive_commit(comm, device)
        except NcclGroupError:
            self._grpo_comm = None  # aborted inside wait_event
            raise
        except BaseException:
            self.grpo_close_weight_group()
            raise
        received_s = time.perf_counter() - start
        if not committed:
            raise RuntimeError(
                "the learner abandoned this update part way (commit word 0); nothing was loaded"
            )
        total = None
        if checksum:
            total = float(sum(flat_checksum(f.to(device, non_blocking=True)) for f in staged))
        weights = [w for flat, b in zip(staged, layout, strict=True) for w in unflatten(flat, b)]
        self._grpo_load(weights)
        del weights, staged
        torch.cuda.empty_cache()  # staging memory back to the KV cache / sleep accounting
        return {
            "checksum": total,
            "received_s": received_s,
            "loaded_s": time.perf_counter() - start - received_s,
            "staged_on": "gpu" if on_gpu else "cpu",
        }

    def _grpo_receive_buckets(
        self, comm: Any, layout: list[Bucket], device: torch.device, on_gpu: bool
    ) -> list[torch.Tensor]:
        """Staged on the GPU, every receive is queued at once (no gap between buckets) and
        then awaited in order; staged on the CPU, one reused GPU buffer per dtype is received
        into and copied out bucket by bucket."""
        stream = torch.cuda.current_stream(device)
        staged: list[torch.Tensor] = []
        recv: dict[torch.dtype, torch.Tensor] = {}
        queued: list[torch.cuda.Event] = []
        for bucket in layout:
            if on_gpu:
                flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
            else:
                if bucket.dtype not in recv:
                    size = max(x.numel for x in layout if x.dtype == bucket.dtype)
                    recv[bucket.dtype] = torch.empty(size, dtype=bucket.dtype, device=device)
                flat = recv[bucket.dtype][: bucket.numel]
            comm.broadcast(flat, src=0, stream=stream)
            done = torch.cuda.Event()
            done.record(stream)
            if on_gpu:
                staged.append(flat)
                queued.append(done)
                continue
            wait_event(done, comm, self._grpo_timeout_s, f"bucket {len(staged) + 1}/{len(layout)}")
            host = torch.empty(bucket.numel, dtype=bucket.dtype, pin_memory=True)
            host.copy_(flat)
            staged.append(host)
        for b, done in enumerate(queued):  # the timeout counts from the previous bucket
            wait_event(done, comm, self._grpo_timeout_s, f"bucket {b + 1}/{len(layout)}")
        return staged

    def _grpo_receive_commit(self, comm: Any, device: torch.device) -> bool:
        word = torch.zeros(1, dtype=torch.int32, device=device)
        stream = torch.cuda.current_stream(device)
        comm.broadcast(word, src=0, stream=stream)
        done = torch.cuda.Event()
        done.record(stream)
        wait_event(done, comm, self._grpo_timeout_s, "commit word")
        return int(word.item()) == 1

    # -- file / HTTP transports ------------------------------------------------------------

    def grpo_load_file(self, path: str) -> int:
        """Load every tensor of a safetensors file (read whole before loading: all or none)."""
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            weights = [(n, f.get_tensor(n)) for n in names]
        self._grpo_load(weights)
        return len(weights)


def _stage_on_gpu(layout: list[Bucket], device: torch.device) -> bool:
    """Stage on the GPU when the whole update fits beside vLLM's pool, else in pinned CPU
    memory (slower: one extra copy each way, but it never OOMs a full server)."""
    free, _ = torch.cuda.mem_get_info(device)
    return sum(b.nbytes for b in layout) + _GPU_STAGING_MARGIN < free
