"""Weight sync over NCCL: learner rank 0 broadcasts flat buckets to every rollout worker.

One ``send`` is one HTTP announce per server (every tensor's name/dtype/shape and the bucket
layout) plus one broadcast per bucket segment (runs of whole tensors of at most
``segment_bytes``: the first leaves while the next are packed) and a final commit word, never
one round trip per tensor.
The announce answers once the server has loaded the update (or refused it), so it runs
concurrently with the broadcasts. After the commit word every worker and the learner join one
sum all-reduce, each worker adding 1 once the update is in its parameters: the learner knows
the load is done without the HTTP answer's trip back, and ``send(wait_answers=False)`` returns
right then (``answers()`` has the HTTP answers later).

``prepare`` moves the announce and the commit off the sync's critical path: called while the
optimizer still steps, it has every server queue the next update's receives
(``POST /weights/nccl/prepare``) and posts the commit (``/weights/nccl/commit``) right away, so
the workers wait for the bytes. The ``send`` that follows only broadcasts and waits for the
workers' acknowledgement: no HTTP call on its path. Any failure of a prepared send drops the
group on this end; the next ``send`` forms it again. A prepared update that will not be sent
(a different one comes) is abandoned: zeros and commit word 0, the servers keep their weights. The wire details (bucket layout, commit word, checksum, abort
on a dead peer) live in ``rollout_server.engine.vllm_worker``, the receiving side, and are
imported from there so both ends share one definition.

Set ``NCCL_CUMEM_ENABLE=0`` in the learner's environment before it starts (the server's vLLM
workers run with it; two ends of one communicator with different settings can hang).

Only the main process sends, but under ZeRO-3 every rank must run the same parameter gathers:
feed ``send`` from ``learner.sync.zero3.iter_gathered_params`` on rank 0 and exhaust the same
iterator on the other ranks. ``send`` always consumes its iterator to the end, even when it
fails, so the ranks' gathers stay in step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rewards._threads import run_in_daemon_thread
from rollout_server.client import RolloutClient, RolloutError, WeightSyncError
from rollout_server.nccl_wire import (
    Bucket,
    BucketEntry,
    NcclGroupError,
    Segment,
    bucket_layout,
    copy_all,
    flat_checksum,
    join_group,
    nccl_abort,
    wait_event,
)
from rollout_server.protocol import (
    NcclInitRequest,
    NcclPrepared,
    NcclUpdateRequest,
    TensorSpec,
    WeightUpdateResponse,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SWITCH_INTERVAL_S = 0.0002  # GIL switch interval while a send is in progress
# Each bucket goes over the wire in runs of whole tensors of at most this many bytes: the first
# leaves while the next are packed, and the servers copy each in as it lands (prepared updates).
SEGMENT_BYTES = 64 << 20

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


class _DaemonWorker:
    """One daemon thread kept for a sender's broadcasts, so that no thread starts on a sync's
    critical path; jobs run in turn. A daemon, as in ``run_in_daemon_thread``: a broadcast that
    can never finish must not keep the interpreter alive at exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        future: Future = Future()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="nccl-weight-sync", daemon=True)
            self._thread.start()
        self._jobs.put((future, fn, args))
        return asyncio.wrap_future(future)

    def _run(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


async def _first_failure(futures: list[asyncio.Future]) -> None:
    """Wait for all; raise the first exception as soon as it happens."""
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    for f in done:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
    assert not pending


@dataclass(frozen=True)
class _PreparedSend:
    request: NcclUpdateRequest
    key: tuple  # _update_key of its arguments (cheaper to compare than the request)
    ids: list[str]  # per server, in client.servers order
    layout: list[Bucket]  # the request's, made at prepare (off the send's critical path)
    commit: asyncio.Future  # the servers' commit, posted right after preparing: their answers


class NcclWeightSender:
    """Learner rank 0 of the weight-sync group. ``init`` once, then ``send`` after each step
    (``prepare`` before it, while the optimizer steps, takes the announce off its path)."""

    def __init__(self) -> None:
        self._client: RolloutClient | None = None
        self._comm: Any = None
        self._init_args: dict[str, Any] = {}
        self._prepared: _PreparedSend | None = None
        self._streams: tuple[Any, Any] | None = None  # (fill, wire) on the learner's GPU
        self._slots: dict[int, _Slots] = {}  # packing buffers by segment size, kept
        self._thread = _DaemonWorker()  # runs the broadcasts
        self._workers = 0  # the servers' workers in the group (each acknowledges a load)
        self._answers: asyncio.Future | None = None  # a send's HTTP answers not awaited yet
        self.last_stats: dict[str, float] = {}
        self.last_prepare_s: float | None = None

    @property
    def ready(self) -> bool:
        return self._comm is not None

    async def init(
        self,
        client: RolloutClient,
        *,
        master_address: str,
        master_port: int,
        device: torch.device | int | str,
        timeout_s: float = 300.0,
    ) -> None:
        """Form the group: rank 0 here, then every worker of every server (from ``/info``).

        ``master_address`` must be an address of this machine that the servers can reach."""
        import importlib.util

        import torch

        from learner.sync import learner_cuda_device

        dev = learner_cuda_device(device, "nccl", "the learner on a CUDA GPU")
        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                'rollout.sync = "nccl": the learner joins the group through vLLM\'s NCCL '
                "wrapper, and vllm is not installed here: pip install 'grpo-service[vllm]' "
                '(or use sync = "http" / "file")'
            )
        if os.environ.get("NCCL_CUMEM_ENABLE") != "0":
            log.warning(
                "NCCL_CUMEM_ENABLE is not 0 in the learner; the rollout workers use 0. Export "
                "NCCL_CUMEM_ENABLE=0 before the learner starts if the first sync hangs."
            )
            os.environ["NCCL_CUMEM_ENABLE"] = "0"  # enough if NCCL is not initialized yet
        self.close()
        self._client = client
        self._init_args = dict(
            master_address=master_address,
            master_port=master_port,
            device=device,
            timeout_s=timeout_s,
        )
        infos = await client.info()
        sizes = [i.tensor_parallel_size * i.data_parallel_size for i in infos]
        multi = len(client.servers) > 1
        if multi and "rank_offset" not in NcclInitRequest.model_fields:
            raise ValueError(
                "NCCL sync to several servers needs NcclInitRequest.rank_offset in the protocol; "
                "use one server, or the http/file transport"
            )
        world_size = 1 + sum(sizes)
        self._workers = world_size - 1
        offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]
        self._device = dev
        if self._device.type == "cuda" and self._device.index is None:
            # accelerate's device without a launcher is a bare "cuda"; the communicator needs
            # the index its tensors will carry
            self._device = torch.device("cuda", torch.cuda.current_device())

        async def post(server: str, offset: int) -> None:
            fields: dict[str, Any] = dict(
                master_address=master_address,
                master_port=master_port,
                world_size=world_size,
                timeout_s=timeout_s,
            )
            if multi:
                fields["rank_offset"] = offset
            body = NcclInitRequest(**fields)
            try:
                await client.nccl_init(server, body)
            except RolloutError as e:
                raise WeightSyncError(server, f"could not join the NCCL weight group: {e}") from e

        posts = [
            asyncio.ensure_future(post(s, o)) for s, o in zip(client.servers, offsets, strict=True)
        ]
        join = run_in_daemon_thread(
            join_group, master_address, master_port, 0, world_size, self._device, timeout_s
        )
        try:
            # A refused POST or a failed join ends the wait at once (the other side would only
            # time out); the join thread is a daemon, left to its own store timeout.
            await _first_failure([*posts, join])
            self._comm = join.result()
        finally:
            for p in posts:
                p.cancel()
        log.info(
            "NCCL weight group ready: world size %d at %s:%d",
            world_size,
            master_address,
            master_port,
        )

    def close(self) -> None:
        """Leave the group. A prepared update still waiting is left to the servers' timeout
        (``_abandon`` ends it at once, when the group still works)."""
        if self._prepared is not None:
            self._prepared.commit.cancel()
            self._prepared = None
        if self._answers is not None:
            self._answers.cancel()
            self._answers = None
        if self._comm is not None:
            nccl_abort(self._comm)
            self._comm = None

    @staticmethod
    def _request(
        specs: Sequence[TensorSpec],
        bucket_bytes: int,
        version: int | None,
        checksum: bool,
        segment_bytes: int,
    ) -> NcclUpdateRequest:
        plan = plan_buckets(specs, bucket_bytes)
        return NcclUpdateRequest(
            tensors=list(specs),
            buckets=plan.buckets,
            bucket_dtypes=plan.dtypes,
            version=version,
            checksum=checksum,
            segment_bytes=segment_bytes,
            ack=True,
        )

    async def prepare(
        self,
        specs: Sequence[TensorSpec],
        *,
        bucket_bytes: int = 1 << 30,
        version: int | None = None,
        checksum: bool = False,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> bool:
        """Have every server queue the receives of the next ``send`` of these ``specs`` (same
        arguments), and post its commit at once: the workers then wait for the bytes, and that
        ``send`` only broadcasts (no HTTP call on its path). Call it while the learner is still
        busy (the optimizer step) and no generation is wanted from the servers: until the
        update is loaded they hold generation paused (requests wait, as behind any weight
        load). ``send`` must follow within the group's ``timeout_s``, or the servers give the
        update up. Returns False, and ``send`` then announces as usual, if a server could not
        prepare (e.g. no GPU memory to stage on)."""
        if self._client is None:
            raise RuntimeError("NcclWeightSender.prepare before init()")
        await self._settle()
        request = self._request(specs, bucket_bytes, version, checksum, segment_bytes)
        key = _update_key(specs, bucket_bytes, version, checksum, segment_bytes)
        if self._prepared is not None:
            if self._prepared.key == key:
                return True
            await self._abandon()  # a different update
        if self._comm is None:
            await self.init(self._client, **self._init_args)
        client = self._client
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(client.nccl_prepare(s, request) for s in client.servers), return_exceptions=True
        )
        failed = [(s, a) for s, a in zip(client.servers, answers, strict=True)
                  if isinstance(a, BaseException)]  # fmt: skip
        if failed:
            for server, exc in failed:
                log.warning("%s could not prepare the NCCL update (%s); it is announced with "
                            "the send instead", server, exc)  # fmt: skip
            if len(failed) < len(answers):
                self.close()  # the others wait on receives: forming the group again drops them
            if not all(isinstance(a, RolloutError) for _, a in failed):
                raise failed[0][1]
            return False
        prepared = [a for a in answers if isinstance(a, NcclPrepared)]
        ids = [a.prepared_id for a in prepared]
        # The commit goes out now, while the learner still steps: the workers then wait for
        # the bytes, and the send has no HTTP call on its path, only the broadcasts.
        commit = asyncio.ensure_future(self._commit(ids))
        self._prepared = _PreparedSend(request, key, ids, _layout(request), commit)
        self.last_prepare_s = time.perf_counter() - start
        return True

    async def send(
        self,
        specs: Sequence[TensorSpec],
        tensor_iter: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = 1 << 30,
        version: int | None = None,
        checksum: bool = False,
        segment_bytes: int = SEGMENT_BYTES,
        on_bucket: Callable[[int], None] | None = None,
        wait_answers: bool = True,
    ) -> list[WeightUpdateResponse] | None:
        """Send one update. ``tensor_iter`` yields the tensors of ``specs`` in that order; each
        is cast to its spec's dtype while it is copied into the bucket.

        Every worker acknowledges the load over NCCL (a sum all-reduce after the commit word)
        as soon as the update is in its parameters. With ``wait_answers=False`` (and no
        ``checksum``) this returns None right then, while the servers finish the commit
        (version bump, resuming generation: any request sent from now on is served by the new
        weights); ``answers()`` returns their HTTP answers, and the next ``send``/``prepare``
        waits for them. Otherwise it returns the answers.

        Raises ``WeightSyncError`` if any server did not load it (those keep their previous
        weights). ``on_bucket(b)`` runs once bucket ``b`` has left this GPU."""
        begun = time.perf_counter(), time.time()  # the sync's time counts from here
        if self._client is None:
            raise RuntimeError("NcclWeightSender.send before init()")
        if self._answers is not None:
            await self._settle()
            begun = time.perf_counter(), time.time()
        specs = list(specs)
        key = _update_key(specs, bucket_bytes, version, checksum, segment_bytes)
        if self._prepared is not None and self._prepared.key != key:
            log.warning("the update differs from the prepared one; announcing it instead")
            await self._abandon()
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            request = prepared.request
        else:
            request = self._request(specs, bucket_bytes, version, checksum, segment_bytes)
        if self._comm is None:  # a failed update aborted the group: form it again
            await self.init(self._client, **self._init_args)
        try:
            return await self._send(
                request, prepared, tensor_iter, on_bucket, begun, not (wait_answers or checksum)
            )
        except BaseException:
            if prepared is not None:
                self.close()  # the servers dropped theirs (and the group) with the commit
            raise

    async def answers(self) -> list[WeightUpdateResponse]:
        """The servers' answers to the last ``send(wait_answers=False)``; raises its failure."""
        pending, self._answers = self._answers, None
        if pending is None:
            raise RuntimeError("no send(wait_answers=False) is waiting for its answers")
        responses = await pending
        self.last_stats["answered_at"] = time.time()
        return responses

    async def _settle(self) -> None:
        """Wait for an earlier send's answers before the next update (its failure raises)."""
        if self._answers is not None:
            try:
                await self.answers()
            except BaseException:
                self.close()  # the group's state is unknown: form it again
                raise

    async def _send(
        self,
        request: NcclUpdateRequest,
        prepared: _PreparedSend | None,
        tensor_iter: Iterable[tuple[str, torch.Tensor]],
        on_bucket: Callable[[int], None] | None,
        begun: tuple[float, float],
        early: bool,
    ) -> list[WeightUpdateResponse] | None:
        checksum = request.checksum
        layout = prepared.layout if prepared is not None else _layout(request)
        marks: dict[str, float] = {}  # the broadcast thread's progress, for profiling
        stop = threading.Event()
        worded = threading.Event()  # the commit word is out: the servers will answer soon
        # Announced: the workers queue their receives on the announce, so it goes first.
        # Prepared: they wait already, and so does the commit, posted after preparing.
        announce = prepared.commit if prepared is not None else (
            asyncio.ensure_future(self._announce(request))
        )  # fmt: skip
        announce.add_done_callback(
            lambda f: stop.set() if f.cancelled() or f.exception() is not None else None
        )
        start, sent_at = begun
        # The broadcast thread fills buckets in Python while this loop writes the announce: with
        # the default 5 ms GIL switch interval the announce could wait that long to go out.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, _SWITCH_INTERVAL_S))
        try:
            sent_checksum, acked = await self._thread.submit(
                self._broadcast,
                layout,
                tensor_iter,
                stop,
                checksum,
                request.segment_bytes,
                on_bucket,
                marks,
                worded,
            )
        except NcclGroupError as exc:
            self._comm = None  # aborted: the next send forms the group again
            if not worded.is_set():
                announce.cancel()  # the servers time out (or never got the announce)
            await asyncio.gather(announce, return_exceptions=True)
            if announce.done() and not announce.cancelled() and announce.exception():
                raise announce.exception() from exc  # the server's reason is the useful one
            raise WeightSyncError("learner", f"NCCL broadcast failed: {exc}") from exc
        except BaseException:
            if not worded.is_set():
                announce.cancel()
            await asyncio.gather(announce, return_exceptions=True)  # the server says why
            raise
        finally:
            sys.setswitchinterval(switch)
        loaded_s = time.perf_counter() - start  # every worker acknowledged the load
        # wall-clock stamps too, to line up with the servers' response timelines
        stats = dict(sent_at=sent_at, prepared=float(prepared is not None), loaded_s=loaded_s)
        early = early and acked == self._workers
        if not early:
            responses = await announce
            if acked != self._workers:  # the answers said nothing wrong, yet one did not load
                raise WeightSyncError(
                    "server", f"only {acked} of {self._workers} workers acknowledged the load"
                )
            stats["answered_at"] = time.time()
        self.last_stats = update_stats(start, request.tensors, **stats)
        self.last_stats["sender_ms"] = {k: (t - start) * 1e3 for k, t in marks.items()}  # type: ignore[assignment]
        if early:
            self._answers = announce
            return None
        if checksum:
            check_checksums(self._client.servers, responses, sent_checksum)
        return responses

    async def _announce(self, request: NcclUpdateRequest) -> list[WeightUpdateResponse]:
        client = self._client
        assert client is not None
        # The first refusal raises at once: it stops the broadcast (the others would wait).
        return await announce_to_all(
            client.servers, lambda s: client.nccl_update(s, request), "NCCL"
        )

    async def _commit(self, ids: list[str]) -> list[WeightUpdateResponse]:
        client = self._client
        assert client is not None
        by_server = dict(zip(client.servers, ids, strict=True))
        return await announce_to_all(
            client.servers, lambda s: client.nccl_commit(s, by_server[s]), "NCCL"
        )

    async def _abandon(self) -> None:
        """Give the prepared update up: its receives (and commit) wait on the servers, so it is
        sent as zeros with commit word 0. They restore what they had and keep the group."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return
        log.info("abandoning the prepared update: zeros and commit word 0")
        begun = time.perf_counter(), time.time()
        try:
            await self._send(prepared.request, prepared, iter(()), None, begun, False)
        except Exception as exc:  # expected: the empty stream, or the servers' refusal
            log.info("the prepared update was abandoned (%s)", exc)

    def _broadcast(
        self,
        layout: list[Bucket],
        tensor_iter: Iterable[tuple[str, torch.Tensor]],
        stop: threading.Event,
        checksum: bool,
        segment_bytes: int,
        on_bucket: Callable[[int], None] | None,
        marks: dict[str, float],
        worded: threading.Event,
    ) -> tuple[float, int]:
        """Fill and broadcast every bucket, then the commit word; wait for the workers' sum of
        acknowledgements. Returns the checksum and that sum.

        If the stream fails or disagrees with ``specs``, the remaining buckets go out as zeros
        with commit word 0: the servers discard everything and the group stays usable. Any
        other failure (no memory, a dead peer) aborts the group; the next send forms it again.
        """
        import torch

        marks["thread"] = time.perf_counter()
        torch.cuda.set_device(self._device)
        it = iter(tensor_iter)
        try:
            total, failure, acked = self._stream_buckets(
                layout, it, stop, checksum, segment_bytes, on_bucket, marks, worded
            )
        except NcclGroupError:
            drain(it, quiet=True)
            raise
        except BaseException as exc:
            nccl_abort(self._comm)
            drain(it, quiet=True)
            raise NcclGroupError(f"the broadcast stopped part way ({exc!r})") from exc
        drain(it, quiet=failure is not None)
        if failure is not None:
            raise failure
        return total, acked

    def _stream_buckets(
        self,
        layout: list[Bucket],
        it: Iterator[tuple[str, torch.Tensor]],
        stop: threading.Event,
        checksum: bool,
        segment_bytes: int,
        on_bucket: Callable[[int], None] | None,
        marks: dict[str, float],
        worded: threading.Event,
    ) -> tuple[float, Exception | None, int]:
        """Every bucket goes out segment by segment (``Bucket.segments``) on a wire stream.

        This thread runs on a fill stream, so the stream's tensors (a ZeRO-3 gather's copies)
        are made there too. A segment of one tensor that already has the bucket's dtype leaves
        from that tensor; the others are packed (one fused multi-tensor copy into kept views)
        into one of two buffers per dtype while the previous segment is on the wire. The two streams wait on each other on
        the GPU (a few reused events per segment): this thread only launches, and blocks once,
        for the workers' acknowledgement after the commit word, unless ``on_bucket`` asks it to
        wait for every bucket. Returns the checksum, the failure if the stream failed (then
        the word was 0) and the sum of acknowledgements."""
        import torch

        comm, timeout_s, device = self._comm, float(self._init_args["timeout_s"]), self._device
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        fill, wire = self._streams
        slots = self._slots.get(segment_bytes)
        if slots is None or not slots.serves(layout):
            if len(self._slots) >= 4:  # one per segment size in use; a few at most
                self._slots.clear()
            slots = self._slots[segment_bytes] = _Slots(layout, segment_bytes, device)
        slots.reset()
        failure: Exception | None = None
        total = torch.zeros((), dtype=torch.float64, device=device) if checksum else None
        ready = torch.cuda.Event()  # the segment just packed (or made) on the fill stream
        fill.wait_stream(torch.cuda.current_stream(device))  # the caller's last writes
        marks["setup"] = time.perf_counter()
        with torch.cuda.stream(fill):
            for b, (bucket, segs) in enumerate(zip(layout, slots.cut, strict=True)):
                for i, g in enumerate(segs):
                    parts = None
                    if failure is None:
                        try:
                            parts = take_tensors(bucket.entries[g.first : g.stop], it)
                            if "taken" not in marks:
                                marks["taken"] = time.perf_counter()
                        except Exception as exc:
                            failure = exc
                            log.error("weight sync abandoned at bucket %d: %s", b, exc)
                    direct = (
                        parts is not None
                        and len(parts) == 1
                        and parts[0].dtype == bucket.dtype
                        and parts[0].device == device
                        and parts[0].is_contiguous()
                    )
                    if direct:
                        flat = parts[0]  # type: ignore[index]
                        flat.record_stream(wire)  # a gathered copy may be freed before it left
                    else:
                        flat, slot, views = slots.take(b, i, wire)
                        if parts is None:
                            flat.zero_()
                        else:
                            copy_all(views, parts)
                    ready.record(fill)
                    wire.wait_event(ready)
                    if total is not None and failure is None:
                        with torch.cuda.stream(wire):
                            total += flat_checksum(flat.view(-1))
                    comm.broadcast(flat, src=0, stream=wire)
                    if not direct:
                        slots.sent(bucket.dtype, slot, wire)
                    del flat, parts
                    if "first" not in marks:
                        marks["first"] = time.perf_counter()
                marks[f"launched{b}"] = time.perf_counter()
                if on_bucket is not None:
                    left = torch.cuda.Event()
                    left.record(wire)
                    wait_event(left, comm, timeout_s, f"bucket {b + 1}", stop)
                    on_bucket(b)
            if failure is None and next(it, None) is not None:
                failure = ValueError(
                    "the tensor stream yielded more tensors than the specs announce"
                )
        with torch.cuda.stream(wire):
            # filled on the GPU: a copy from pageable host memory would first wait for the stream
            word = torch.full((1,), 0 if failure else 1, dtype=torch.int32, device=device)
            acks = torch.zeros(1, dtype=torch.int32, device=device)
        comm.broadcast(word, src=0, stream=wire)
        # each worker adds 1 once the update is in its parameters (its HTTP commit got there)
        comm.all_reduce(acks, acks, stream=wire)
        done = torch.cuda.Event()
        done.record(wire)
        marks["word"] = time.perf_counter()
        worded.set()
        wait_event(done, comm, timeout_s, "the servers' acknowledgement of the load", stop)
        marks["acked"] = time.perf_counter()
        acked = int(acks.item())
        return (float(total) if total is not None else 0.0), failure, acked


class _Slots:
    """Two packing buffers per dtype, taken in turn on the (current) fill stream, with the
    views that the segments' tensors are copied into (made once per layout and kept, with the
    buffers, for the next send of it). A buffer is refilled only after the segment last sent
    from it has left (a wait on the GPU, not here); a segment larger than the buffers (one
    tensor that needs a cast) gets one of its own."""

    def __init__(self, layout: list[Bucket], segment_bytes: int, device: torch.device) -> None:
        import torch

        self.layout, self.segment_bytes = layout, segment_bytes
        self.cut = [bucket.segments(segment_bytes) for bucket in layout]
        numel: dict[torch.dtype, int] = {}
        for bucket, segs in zip(layout, self.cut, strict=True):
            for g in segs:
                if g.stop - g.first > 1:
                    numel[bucket.dtype] = max(numel.get(bucket.dtype, 0), g.numel)
        self._buffers = {
            d: [torch.empty(n, dtype=d, device=device) for _ in range(2)] for d, n in numel.items()
        }
        self._left = {d: [torch.cuda.Event(), torch.cuda.Event()] for d in numel}
        self._used = {d: [False, False] for d in numel}
        self._turn: dict[torch.dtype, int] = dict.fromkeys(numel, 0)
        self._views: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self._device = device

    def serves(self, layout: list[Bucket]) -> bool:
        return layout is self.layout or layout == self.layout

    def reset(self) -> None:
        """A new send: the previous one's segments have all left."""
        for used in self._used.values():
            used[:] = [False, False]

    def take(
        self, b: int, i: int, wire: torch.cuda.Stream
    ) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        """Segment ``i`` of bucket ``b``: its buffer, slot (-1: a buffer of its own) and the
        views of its tensors into the buffer."""
        import torch

        bucket, g = self.layout[b], self.cut[b][i]
        buffers = self._buffers.get(bucket.dtype)
        if buffers is None or g.numel > buffers[0].numel():
            out = torch.empty(g.numel, dtype=bucket.dtype, device=self._device)
            out.record_stream(wire)
            return out, -1, segment_views(out, bucket, g)
        k = self._turn[bucket.dtype]
        self._turn[bucket.dtype] = 1 - k
        if self._used[bucket.dtype][k]:
            torch.cuda.current_stream(self._device).wait_event(self._left[bucket.dtype][k])
        flat = buffers[k][: g.numel]
        views = self._views.get((k, b, i))
        if views is None:
            views = self._views[(k, b, i)] = segment_views(flat, bucket, g)
        return flat, k, views

    def sent(self, dtype: torch.dtype, slot: int, wire: torch.cuda.Stream) -> None:
        if slot >= 0:
            self._left[dtype][slot].record(wire)
            self._used[dtype][slot] = True


def _update_key(specs: Sequence[TensorSpec], *args: Any) -> tuple:
    """What makes two updates the same: every spec, and the other arguments."""
    return (tuple((s.name, s.dtype, *s.shape) for s in specs), *args)


def _layout(request: NcclUpdateRequest) -> list[Bucket]:
    specs = [s.model_dump() for s in request.tensors]
    return bucket_layout(specs, request.buckets, request.bucket_dtypes)


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
